"""LoopMailbox: chunks put from another thread reach their asyncio queues in order, with one loop wake-up per
batch instead of one per chunk, and a closed loop is an error the scheduler can act on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sglx.llm.loop_mailbox import LoopMailbox, MailboxRegistry


def test_batched_wakeups_keep_order_per_queue() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        box = LoopMailbox(loop)
        wakeups = [0]
        original = loop.call_soon_threadsafe

        def counting(*args: object) -> object:
            wakeups[0] += 1
            return original(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(3)]

        def producer() -> None:  # one "step": a chunk for every queue, three steps
            for step in range(3):
                for q in queues:
                    box.put(q, step)

        thread = threading.Thread(target=producer)
        thread.start()
        thread.join()  # the loop has not run in between: everything waits in one batch
        got = [[await q.get() for _ in range(3)] for q in queues]
        return got, wakeups[0]

    got, wakeups = asyncio.run(main())
    assert got == [[0, 1, 2]] * 3
    assert wakeups == 1  # 9 chunks, one wake-up (call_soon_threadsafe would have written 9 times)


def test_closed_loop_raises_and_registry_is_per_loop() -> None:
    loop = asyncio.new_event_loop()
    box = MailboxRegistry().for_loop(loop)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.put(asyncio.Queue(), 1)
    reg = MailboxRegistry()
    a, b = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert reg.for_loop(a) is reg.for_loop(a) and reg.for_loop(a) is not reg.for_loop(b)
    finally:
        a.close()
        b.close()
