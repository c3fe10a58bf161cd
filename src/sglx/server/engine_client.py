"""The HTTP process's side of `sglx serve`: the engine runs in a child process (sglx.server.engine_process).

In one process the HTTP event loop (SSE writes, request parsing) and the scheduler loop took turns on one GIL,
so steps waited for the server's per-token work. Here the scheduler runs in its own interpreter; this process
tokenizes, validates and streams (CPU, interleaved A/B: 0.90-0.94x of the offline engine's throughput at the
median against 0.71-0.72x in one process; docs/benchmarks.md).

A reader thread takes the engine's messages (one per scheduler step) and hands each request's chunks to its
event loop through a LoopMailbox (one wake-up per step). If the engine process dies, every open request ends
with an error chunk (a 500 for the client, or an error event in its stream), /health answers 503 with the reason
and `on_death` is called (the server then exits with code 1, so a supervisor can restart it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from sglx import exit_codes
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig
from sglx.llm.loop_mailbox import LoopMailbox, MailboxRegistry
from sglx.llm.sampling import SamplingParams
from sglx.server.errors import APIError
from sglx.server.state import engine_failure

log = logging.getLogger("sglx.server")

STOP_TIMEOUT_S = 30.0  # the engine process gets this long to stop (its scheduler waits up to 10 s for a step)
CALL_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 5.0
SHUT_DOWN = "the engine was shut down"


class EngineStartError(SglxError):
    """The engine process could not start (bad flags, missing weights, ...): its one-line reason."""


class EngineExited(Exception):
    """The engine process left without serving, as it was meant to: a tensor-parallel rank > 0 started by
    torchrun serves rank 0 from inside Engine() and then exits. The server exits with `code` too."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the engine process exited with code {code}")
        self.code = code


def describe_exit(code: int | None) -> str:
    """How the engine process ended; no exit code yet means it stopped answering."""
    return exit_codes.describe_exit(code, running="is not answering")


class EngineClient:
    """ServedEngine over an engine process. `EngineClient.start(config)` returns once the engine is warm."""

    def __init__(self, process: subprocess.Popen, conn: Connection, facts: dict[str, Any],
                 config: EngineConfig) -> None:
        self.process = process
        self.config = config
        self.model_path: str = facts["model_path"]
        self.vocab_size: int = facts["vocab_size"]
        self.context_length: int = facts["context_length"]
        self.capacity: int = facts["capacity"]
        self._info: dict[str, Any] = facts["info"]
        self.tokenizer = None
        if facts["tokenizer_path"] is not None:
            from sglx.llm.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(facts["tokenizer_path"])
        self.on_death: Callable[[str], None] | None = None  # called once, from the reader thread
        self.death: str | None = None  # why the engine process ended, if it ended without being asked to
        self._conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the two tables and `_closed`
        self._streams: dict[int, tuple[LoopMailbox, asyncio.Queue[Any], int]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._closed: str | None = None  # set once no request can be sent any more (the reason)
        self._stopping = False
        self._keys = itertools.count()
        self._mailboxes = MailboxRegistry()
        self._reader = threading.Thread(target=self._read_loop, name="sglx-engine-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ start

    @classmethod
    def start(cls, config: EngineConfig, log_level: str = "info") -> EngineClient:
        """Start the engine process, send it the config, wait until it loaded and warmed up the model."""
        ours, theirs = socket.socketpair()
        conn = Connection(ours.detach())
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "sglx.server.engine_process", "--fd", str(theirs.fileno()),
                 "--parent", str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        try:
            conn.send(("start", config, log_level))
            facts = cls._wait_ready(process, conn)
            return cls(process, conn, facts, config)  # loads the tokenizer, then starts reading
        except BaseException:
            conn.close()
            with contextlib.suppress(ProcessLookupError):
                process.terminate()  # it may be loading weights, not reading the socket
            _stop_process(process, 10.0)
            raise

    @staticmethod
    def _wait_ready(process: subprocess.Popen, conn: Connection) -> dict[str, Any]:
        while True:  # no deadline: loading an 8B model and capturing CUDA graphs takes what it takes
            if conn.poll(0.2):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = ("gone",)
                if message[0] == "ready":
                    return dict(message[1])
                if message[0] == "failed":
                    raise (SglxError if message[2] else EngineStartError)(message[1])
                if message[0] == "exit":
                    process.wait(10.0)
                    raise EngineExited(int(message[1]))
                code = process.wait(10.0)
                raise EngineStartError(f"the engine process {describe_exit(code)} while starting (its log is above)")
            if process.poll() is not None:
                raise EngineStartError(f"the engine process {describe_exit(process.returncode)} while starting "
                                       "(its log is above)")

    # ------------------------------------------------------------------ ServedEngine

    @property
    def info(self) -> dict[str, Any]:
        return self._info

    async def health(self) -> tuple[bool, str | None]:
        """(scheduler alive, failure): asks the engine process, which also watches its tensor-parallel ranks."""
        if self._closed is not None:
            return False, self.death
        try:
            state = await self._call("health", HEALTH_TIMEOUT_S)
        except APIError as exc:
            return False, self.death or exc.message
        except asyncio.TimeoutError:
            return False, f"the engine process did not answer within {HEALTH_TIMEOUT_S:.0f} s"
        return bool(state["alive"]), state["failure"]

    async def load(self) -> dict[str, int]:
        return dict(await self._call("load"))

    async def current_info(self) -> dict[str, Any]:
        self._info = dict(await self._call("info"))
        return self._info

    async def flush_cache(self) -> int:
        return int(await self._call("flush"))

    async def generate_stream(self, prompt: Any, sampling_params: SamplingParams, input_ids: Sequence[int],
                              return_logprob: bool = False, top_logprobs: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The chunks of one request, as Engine.generate_stream yields them; leaving early aborts it."""
        if prompt is not None or input_ids is None:
            raise SglxError("the engine process takes token ids; encode the prompt first")
        ids = [int(t) for t in input_ids]
        key = next(self._keys)
        q: asyncio.Queue[Any] = asyncio.Queue()
        mailbox = self._mailboxes.for_loop(asyncio.get_running_loop())
        with self._lock:
            closed = self._closed
            if closed is None:
                self._streams[key] = (mailbox, q, len(ids))
        if closed is not None:  # as a request the engine failed: a 5xx, not a client error
            yield failed_chunk(closed, len(ids))
            return
        finished = False
        try:
            try:
                self._send(("submit", key, ids, SamplingParams.from_any(sampling_params), return_logprob,
                            int(top_logprobs)))
            except SglxError as exc:
                finished = True
                yield failed_chunk(str(exc), len(ids))
                return
            while not finished:
                chunk = await q.get()
                if isinstance(chunk, SglxError):
                    finished = True
                    raise chunk
                finished = chunk["finished"]
                yield chunk
        finally:
            with self._lock:
                self._streams.pop(key, None)
            if not finished:
                with contextlib.suppress(SglxError):
                    self._send(("abort", key))

    def shutdown(self) -> None:
        """Stop the engine process (its open requests end as aborted) and wait for it; kill it if it hangs."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        with contextlib.suppress(SglxError):
            self._send(("shutdown",))
        _stop_process(self.process, STOP_TIMEOUT_S)
        self._reader.join(5.0)
        self._conn.close()

    # ------------------------------------------------------------------ plumbing

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # ValueError: the connection was closed
            raise SglxError(self._closed or f"the engine process is unreachable: {exc}") from None

    async def _call(self, name: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._keys)
        with self._lock:
            if self._closed is not None:
                raise engine_failure(self._closed)
            self._calls[call_id] = (loop, future)
        try:
            try:
                self._send(("call", call_id, name))
            except SglxError as exc:
                raise engine_failure(str(exc)) from None
            return await asyncio.wait_for(future, timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def _read_loop(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":
                    self._deliver(message[1])
                elif kind == "rejected":
                    self._deliver([(message[1], SglxError(message[2]))])
                elif kind == "reply":
                    self._answer(*message[1:])
                elif kind == "stopped":
                    break
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a message this side cannot read: treat the engine as lost
            log.exception("unreadable message from the engine process")
        self._lost()

    def _deliver(self, items: list[tuple[int, Any]]) -> None:
        with self._lock:
            targets = [(self._streams.get(key), item) for key, item in items]
        for target, item in targets:
            if target is not None:  # None: the request was left (aborted) meanwhile
                with contextlib.suppress(RuntimeError):  # its event loop is closed
                    target[0].put(target[1], item)

    def _answer(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            entry = self._calls.get(call_id)
        if entry is None:
            return
        loop, future = entry

        def settle() -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(engine_failure(str(value)))

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)

    def _lost(self) -> None:
        """The engine process stopped sending: end every open request and call, say why from now on."""
        if self._stopping:
            reason = SHUT_DOWN
        else:
            try:
                code: int | None = self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                code = None
            reason = f"the engine process {describe_exit(code)}; this server cannot generate any more"
            self.death = reason
            log.error(reason)
        with self._lock:
            self._closed = reason
            streams = list(self._streams.items())
            calls = list(self._calls.values())
        for _key, (mailbox, q, prompt_tokens) in streams:
            with contextlib.suppress(RuntimeError):
                mailbox.put(q, failed_chunk(reason, prompt_tokens))
        for loop, future in calls:
            def fail(future: asyncio.Future[Any] = future) -> None:
                if not future.done():
                    future.set_exception(engine_failure(reason))
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fail)
        if self.death is not None and self.on_death is not None:
            self.on_death(reason)


def failed_chunk(reason: str, prompt_tokens: int) -> dict[str, Any]:
    """The last chunk of a request whose engine went away: finished, aborted, with the reason as its error."""
    result = {"rid": None, "text": "", "output_ids": [], "prompt_tokens": prompt_tokens, "completion_tokens": 0,
              "cached_tokens": 0, "finish_reason": "abort", "matched_stop": None, "error": reason,
              "num_retractions": 0, "e2e_latency": None, "ttft": None}
    return {"rid": None, "text": "", "output_ids": [], "finished": True, "finish_reason": "abort",
            "matched_stop": None, "error": reason, "result": result}


def _stop_process(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("the engine process did not stop within %.0f s; killing it", timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its own session: its tensor-parallel ranks too
        process.wait(10.0)
