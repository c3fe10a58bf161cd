"""Run the choices of one HTTP request on the engine and merge their chunks, recording metrics on the way.

Each choice is one engine request (n > 1 and batched prompts give several). Their chunks arrive
as the scheduler produces them; leaving the iteration early (client gone, server stopping) cancels
every choice, which aborts its engine request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from sglx.llm.sampling import SamplingParams
from sglx.server.errors import APIError
from sglx.server.metrics import ServerMetrics
from sglx.server.served_engine import ServedEngine

T = TypeVar("T")


@dataclass(frozen=True)
class Choice:
    """One generation: its output index, which prompt it belongs to, its tokens and parameters."""

    index: int
    prompt_index: int
    input_ids: list[int]
    params: SamplingParams
    logprobs: bool = False
    top_logprobs: int = 0


_END = object()


async def run_choices(engine: ServedEngine, choices: list[Choice], metrics: ServerMetrics,
                      arrival: float) -> AsyncIterator[tuple[Choice, dict[str, Any]]]:
    """Yield (choice, chunk) as chunks come, from all choices interleaved; the last chunk of each has "result"."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            first = last = None
            async for chunk in engine.generate_stream(None, choice.params, input_ids=choice.input_ids,
                                                      return_logprob=choice.logprobs,
                                                      top_logprobs=choice.top_logprobs):
                now = time.perf_counter()
                n = len(chunk["output_ids"])
                if n:
                    if first is None:
                        first = now
                        metrics.ttft.observe(now - arrival)
                        n -= 1
                    if n and last is not None:
                        for _ in range(n):
                            metrics.itl.observe((now - last) / n)
                    last = now
                    metrics.generation_tokens += len(chunk["output_ids"])
                if chunk["finished"]:
                    metrics.finished[chunk["finish_reason"] or "unknown"] += 1
                    metrics.prompt_tokens += len(choice.input_ids)
                    metrics.e2e.observe(now - arrival)
                await queue.put((choice, chunk))
        except asyncio.CancelledError:  # client gone or server stopping: the engine request is aborted
            metrics.finished["abort"] += 1
            raise
        except Exception as exc:  # handed to the consumer, which turns it into an error response
            await queue.put(exc)
        finally:
            await queue.put(_END)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # a no-op for finished ones; aborts the engine request of the others
            task.cancel()


async def until_disconnect(receive: Any, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its engine requests) if the client disconnects first."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return task.result()
