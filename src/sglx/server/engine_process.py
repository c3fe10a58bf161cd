"""The engine process of `sglx serve`: model, KV cache and scheduler loop, away from the HTTP process's GIL.

Started by sglx.server.engine_client.EngineClient as `python -m sglx.server.engine_process --fd N --parent PID`
(a fresh interpreter, so CUDA is safe; SGLang splits its server the same way: HTTP/tokenizer process and
scheduler process). The two talk over one socket pair with multiprocessing.connection's framing (pickled tuples):

    HTTP -> engine   ("start", EngineConfig, log_level), then ("submit", key, input_ids, SamplingParams,
                     return_logprob, top_logprobs), ("abort", key), ("call", call_id, "load"|"info"|"flush"|"health"),
                     ("shutdown",)
    engine -> HTTP   ("ready", facts), ("failed", message, usage_error) or ("exit", code), then
                     ("out", [(key, chunk dict), ...])
                     once per scheduler step, ("rejected", key, message), ("reply", call_id, ok, value), ("stopped",)

Requests are token ids (the HTTP process tokenizes); text is detokenized here, in the scheduler loop, as in the
offline engine. The process leaves when told to, when the socket closes (the HTTP process is gone) or on
SIGTERM (sent by the kernel when the HTTP process dies: PR_SET_PDEATHSIG); it ignores SIGINT, which the HTTP
process handles for both.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("sglx.server.engine")


class EngineHost:
    """Runs one Engine for the HTTP process: takes its messages on the main thread, ships outputs per step."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        from sglx.llm.engine import chunk_dict

        self.engine = engine
        self.conn = conn
        self._chunk_dict = chunk_dict
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[int, dict[str, Any]]] = []  # filled and shipped by the scheduler thread only
        self._rids: dict[int, str] = {}
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sglx-engine-call")
        engine.scheduler.after_step = self._ship

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def facts(self) -> dict[str, Any]:
        """What the HTTP process needs to validate and describe requests without asking again."""
        e = self.engine
        tokenizer_path = str(e.config.tokenizer_path or e.runner.model_path) if e.tokenizer is not None else None
        return {"model_path": str(e.runner.model_path), "vocab_size": int(e.model_config.vocab_size),
                "context_length": int(e.runner.memory.context_length), "capacity": int(e.scheduler.capacity()),
                "tokenizer_path": tokenizer_path, "info": e.info, "pid": os.getpid()}

    # ------------------------------------------------------------------ scheduler thread

    def _output(self, key: int) -> Any:
        def on_output(chunk: Any) -> None:
            self._outbox.append((key, self._chunk_dict(chunk)))
            if chunk.finished:
                self._rids.pop(key, None)
        return on_output

    def _ship(self) -> None:
        """after_step: every chunk of this scheduler step in one message (one wake-up of the HTTP process)."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        with contextlib.suppress(OSError):  # the HTTP process is gone; the main thread stops the engine
            self.send(("out", items))

    # ------------------------------------------------------------------ main thread

    def serve(self) -> None:
        """Handle messages until "shutdown" or until the HTTP process closes the socket."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.warning("the HTTP process closed the connection; stopping the engine")
                return
            kind = message[0]
            if kind == "submit":
                self._submit(*message[1:])
            elif kind == "abort":
                rid = self._rids.get(message[1])
                if rid is not None:
                    self.engine.abort(rid)
            elif kind == "call":
                self._call(message[1], message[2])
            elif kind == "shutdown":
                return

    def _submit(self, key: int, input_ids: list[int], params: Any, return_logprob: bool, top_logprobs: int) -> None:
        from sglx.errors import SglxError

        try:
            self._rids[key] = self.engine.submit(input_ids, params, self._output(key), True, return_logprob,
                                                 top_logprobs)
        except SglxError as exc:
            self.send(("rejected", key, str(exc)))

    def _call(self, call_id: int, name: str) -> None:
        if name == "health":  # answered at once, never behind a step
            failure = self.engine.failure
            self._reply(call_id, True, {"alive": self.engine.scheduler.alive,
                                        "failure": None if failure is None else str(failure)})
        elif name == "info":
            self._reply(call_id, True, self.engine.info)
        else:  # load and flush wait for the step in flight: off this thread, so submits keep flowing
            self._calls.submit(self._slow_call, call_id, name)

    def _slow_call(self, call_id: int, name: str) -> None:
        from sglx.server.engine_state import engine_load

        try:
            value: Any = engine_load(self.engine) if name == "load" else self.engine.flush_cache()
        except Exception as exc:  # noqa: BLE001 - handed to the HTTP process as its error
            self._reply(call_id, False, f"{type(exc).__name__}: {exc}")
            return
        self._reply(call_id, True, value)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        with contextlib.suppress(OSError):
            self.send(("reply", call_id, ok, value))

    def close(self) -> None:
        """Stop the engine (aborting what still runs: those chunks are shipped by the loop's last after_step)."""
        self.engine.shutdown()
        self._calls.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self.send(("stopped",))


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM from the kernel when the HTTP process dies, even by SIGKILL (Linux); gone already: exit now."""
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        sys.exit(0)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sglx serve's engine process (started by the server, not by hand)")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the HTTP process")
    ap.add_argument("--parent", type=int, required=True, help="the HTTP process's pid")
    args = ap.parse_args(argv)
    _die_with_parent(args.parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    conn = Connection(args.fd)
    try:
        _, config, log_level = conn.recv()
    except (EOFError, OSError):
        return 0
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from sglx.llm.engine import Engine
        from sglx.server.runner import warm_up

        engine = Engine(config)
    except SystemExit as exc:  # a tensor-parallel rank > 0 that torchrun started: it served rank 0, now it leaves
        code = exc.code if isinstance(exc.code, int) else 1
        with contextlib.suppress(OSError):
            conn.send(("exit", code))
        return code
    except BaseException as exc:
        _report_start_failure(conn, exc)
        return 1
    host = EngineHost(engine, conn)
    try:
        warm_up(engine)
        host.send(("ready", host.facts()))
    except BaseException as exc:
        _report_start_failure(conn, exc)
        engine.shutdown()
        return 1
    try:
        host.serve()
    finally:
        host.close()
        conn.close()
    if config.tp_size == 1:  # started no process of its own: skip the interpreter's teardown of torch (~0.5 s)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _report_start_failure(conn: Connection, exc: BaseException) -> None:
    from sglx.errors import SglxError

    usage = isinstance(exc, SglxError)
    if not usage and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        traceback.print_exc()
    message = str(exc) if usage else f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(OSError):
        conn.send(("failed", message, usage))


if __name__ == "__main__":
    sys.exit(main())
