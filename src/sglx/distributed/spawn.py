"""sglx's own launcher: N worker processes on this machine, no hung ranks, the first failure as one line.

Two ways to use it:

* `spawn_workers(fn, world_size, args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes
  (torch.multiprocessing, "spawn" start method, so CUDA works in every child) and returns their results in
  rank order. Tests and batch jobs use it.
* `start_workers(fn, world_size, args, ranks=range(1, world_size))` starts only some ranks in the
  background and returns a `WorkerGroup`; the calling process plays the remaining rank itself (the
  driver: rank 0 of tensor-parallel serving). The group watches its workers from a thread and reports the
  first failure through `WorkerGroup.failure` / `check()` and an optional callback.

Every child gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) on a
free local port, plus the variables that keep NVLink multicast off, so inside `fn`
`sglx.distributed.init_distributed()` needs no arguments. A child whose parent dies exits by itself.
When any rank fails, every other rank is terminated (then killed) and the failure is raised as one
`WorkerError` line: "rank 1 of 2 failed: ValueError: ...". Picklable `fn` and `args` only (module-level
functions).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from sglx.distributed.group import MULTICAST_OFF_ENV, DistContext, destroy_distributed, init_distributed
from sglx.errors import SglxError
from sglx.exit_codes import describe_exit

TERMINATE_GRACE_S = 3.0
REPORT_GRACE_S = 5.0  # how long a rank that exited may take to have its report read


class WorkerError(SglxError):
    """A worker rank raised, died, or the group timed out; the message is one line naming the rank."""

    def __init__(self, message: str, rank: int | None = None, details: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.details = details  # the worker's traceback, for logs; never printed by the CLI


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, the form every worker failure is reported in."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def worker_env(rank: int, world_size: int, master_addr: str, master_port: int,
               local_rank: int | None = None) -> dict[str, str]:
    """The torchrun-style variables a rank needs, plus NVLink multicast off."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank if local_rank is None else local_rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), **MULTICAST_OFF_ENV}


def _exit_with_parent() -> None:
    """Leave as soon as the parent process is gone (no orphaned rank waiting in a collective)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        with _RELEASE_LOCK:  # not while the main thread is inside a finalizer (os._exit would cut it short)
            release_semaphores()
        os._exit(3)

    threading.Thread(target=watch, name="sglx-parent-watch", daemon=True).start()


def release_semaphores() -> None:
    """Unlink the named semaphores this process created and take them off the resource tracker's list.

    Why: a rank's default start method is "spawn", so every multiprocessing lock made inside it (tqdm makes one
    for every progress bar: "Loading weights", "Writing model shards") is a named POSIX semaphore registered with
    the resource tracker that the rank shares with its parent. A normal exit unlinks them (multiprocessing's exit
    finalizers); os._exit and a terminating signal skip that, and the tracker, when it ends with the parent,
    unlinks them itself and prints "resource_tracker: There appear to be N leaked semaphore objects". Only the
    semaphores' own finalizers run here: nothing that could block (no pool joins, no process-group teardown).
    """
    from multiprocessing import synchronize, util

    registry = getattr(util, "_finalizer_registry", None) or {}
    for finalizer in list(registry.values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            with contextlib.suppress(Exception):
                finalizer()


_RELEASE_LOCK = threading.Lock()
_releasing = False  # touched on the main thread only (Python runs signal handlers there)


def _release_before_exit() -> bool:
    """Main thread, once per process: stop listening to SIGTERM, then release the semaphores.

    Why SIG_IGN and not a signal mask: the parent sends SIGTERM to the process (twice when a failure is followed by
    shutdown), and the kernel hands a process-directed signal to any thread that does not block it, such as the
    parent-watch thread; Python then runs the handler on the main thread between two bytecodes, possibly inside a
    finalizer that has unlinked its semaphore and not yet unregistered it, and the handler's own exit cut it there
    (the tracker then warned about a name that no longer existed). Ignoring is process-wide. False when a release
    is already under way on this thread (a handler tripped before SIGTERM was ignored runs late, inside it).
    """
    global _releasing
    if _releasing:
        return False
    _releasing = True
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with _RELEASE_LOCK:
        release_semaphores()
    return True


def _release_on_sigterm() -> None:
    """SIGTERM (WorkerGroup.terminate ends the other ranks after a failure): release the semaphores, then die of
    SIGTERM as before (the exit status still says so). A rank stuck in a C call gets here when the call returns,
    or is SIGKILLed after the grace period; a SIGKILL leaves its semaphores to the tracker."""
    import signal

    def handler(signum: int, _frame: Any) -> None:
        if not _release_before_exit():
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def _worker_main(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, env: dict[str, str],
                 results: Any) -> None:
    os.environ.update(env)
    _exit_with_parent()
    _release_on_sigterm()
    try:
        value = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit/KeyboardInterrupt
        results.put((rank, False, one_line(exc), traceback.format_exc()))
        results.close()
        results.join_thread()
        # The parent terminates the other ranks as soon as it reads this report, this one too if it is still
        # alive: from here on SIGTERM is ignored, so it cannot cut a semaphore's finalizer short.
        _release_before_exit()  # os._exit skips the finalizers that would
        os._exit(1)  # skip torch's atexit teardown, which can block on a group whose peers are gone
    # pickled here with the standard pickler: torch's queue reducers would pass tensors as shared-memory
    # handles, which the parent cannot open once this process has exited
    results.put((rank, True, pickle.dumps(value), ""))
    results.close()
    results.join_thread()
    with contextlib.suppress(Exception):
        destroy_distributed()


@dataclass
class _Failure:
    rank: int
    message: str
    details: str = ""


class WorkerGroup:
    """Background ranks started by `start_workers`; a thread watches them and records the first failure."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: Sequence[Any], ranks: Iterable[int], *,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 on_failure: Callable[[WorkerError], None] | None = None) -> None:
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port or find_free_port(master_addr)
        self.ranks = list(ranks)
        self._ctx = mp.get_context("spawn")
        self._results = self._ctx.Queue()
        self._procs: dict[int, Any] = {}
        self._values: dict[int, Any] = {}
        self._failure: _Failure | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._on_failure = on_failure
        for rank in self.ranks:
            env = worker_env(rank, world_size, master_addr, self.master_port)
            proc = self._ctx.Process(target=_worker_main, args=(fn, rank, world_size, tuple(args), env, self._results),
                                     name=f"sglx-rank{rank}", daemon=True)
            proc.start()
            self._procs[rank] = proc
        self._watcher = threading.Thread(target=self._watch, name="sglx-worker-watch", daemon=True)
        self._watcher.start()

    # ---------------------------------------------------------------- state

    @property
    def env(self) -> dict[str, str]:
        """Rendezvous variables for the rank the calling process plays (pass to init_distributed)."""
        return worker_env(0, self.world_size, self.master_addr, self.master_port)

    @property
    def failure(self) -> WorkerError | None:
        f = self._failure
        if f is None:
            return None
        return WorkerError(f"rank {f.rank} of {self.world_size} failed: {f.message}", f.rank, f.details)

    @property
    def done(self) -> bool:
        return all(r in self._values for r in self.ranks)

    def join_as_driver(self, *, device: str | None, what: str, timeout_s: float) -> DistContext:
        """init_distributed as rank 0 on a thread, so that a worker dying first ends the wait at once.

        `what` names the ranks in the timeout's line ("tensor-parallel workers"); the caller decides whether
        a failure here also ends the workers.
        """
        init_method = f"tcp://{self.master_addr}:{self.master_port}"  # this process's environment untouched
        box: list[Any] = []

        def join() -> None:
            try:
                box.append(init_distributed(0, self.world_size, init_method=init_method, device=device))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box.append(exc)

        thread = threading.Thread(target=join, name="sglx-driver-init", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.1)
            failure = self.failure
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                raise WorkerError(f"{what} did not join within {timeout_s:.0f} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop_with_failure(self, rank: int, message: str) -> None:
        """Record a failure found outside the workers (e.g. in the driver's own rank) and end every worker."""
        self._fail(rank, message)

    def check(self) -> None:
        """Raise the first worker failure, if any."""
        err = self.failure
        if err is not None:
            raise err

    # ---------------------------------------------------------------- watching

    def _drain(self, timeout: float) -> None:
        try:
            rank, ok, value, details = self._results.get(timeout=timeout)
        except (queue.Empty, EOFError, OSError):
            return
        if ok:
            self._values[rank] = pickle.loads(value)
        else:
            self._fail(rank, value, details)

    def _fail(self, rank: int, message: str, details: str = "") -> None:
        with self._lock:
            if self._failure is not None or self._closing:
                return
            self._failure = _Failure(rank, message, details)
        self.terminate()
        if self._on_failure is not None:
            self._on_failure(self.failure)  # type: ignore[arg-type]

    def _watch(self) -> None:
        while not self._closing and self._failure is None:
            self._drain(0.1)
            for rank, proc in self._procs.items():
                if proc.exitcode is not None and rank not in self._values and self._failure is None:
                    deadline = time.monotonic() + REPORT_GRACE_S  # its report may still be in the pipe
                    while rank not in self._values and self._failure is None and time.monotonic() < deadline:
                        self._drain(0.1)
                    if rank not in self._values and self._failure is None and not self._closing:
                        self._fail(rank, f"the process {describe_exit(proc.exitcode)} without reporting")
            if self.done and all(p.exitcode is not None for p in self._procs.values()):
                return

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        """Block until every background rank returned; their results in rank order. Raises the first failure."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r in self.ranks if r not in self._values]
                self._fail(running[0], f"timed out after {timeout_s:.0f} s (ranks still running: {running})")
                self.check()
            self._watcher.join(0.05)
            if not self._watcher.is_alive() and not self.done:
                self._drain(0.2)
                self.check()
        self.check()
        for proc in self._procs.values():
            proc.join(TERMINATE_GRACE_S)
        return [self._values[r] for r in self.ranks]

    def terminate(self) -> None:
        """Stop every background rank: SIGTERM, then SIGKILL after a short grace."""
        procs = [p for p in self._procs.values() if p.is_alive()]
        for p in procs:
            with contextlib.suppress(Exception):
                p.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                with contextlib.suppress(Exception):
                    p.kill()
                p.join(1.0)

    def shutdown(self) -> None:
        """Stop watching and end every background rank (safe to call twice)."""
        self._closing = True
        self.terminate()
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join(1.0)


def start_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                  ranks: Iterable[int] | None = None, master_addr: str = "127.0.0.1",
                  master_port: int | None = None,
                  on_failure: Callable[[WorkerError], None] | None = None) -> WorkerGroup:
    """Start `fn(rank, world_size, *args)` for `ranks` (default 1..world_size-1) in the background.

    The caller plays the other rank(s): `os.environ.update(group.env)` then `init_distributed(0, world_size)`.
    `on_failure(error)` runs on the watcher thread after a rank failed and the others were terminated.
    """
    return WorkerGroup(fn, world_size, args, range(1, world_size) if ranks is None else ranks,
                       master_addr=master_addr, master_port=master_port, on_failure=on_failure)


def spawn_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                  timeout_s: float | None = None, master_addr: str = "127.0.0.1") -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes; return their results in rank order.

    The first rank to raise (or die, or outlive `timeout_s`) ends every other rank and is re-raised here
    as one `WorkerError` line. Results travel back pickled, so keep them small (tensors on CPU).
    """
    if world_size < 1:
        raise WorkerError(f"cannot spawn {world_size} workers: world size must be >= 1")
    group = WorkerGroup(fn, world_size, args, range(world_size), master_addr=master_addr)
    try:
        return group.wait(timeout_s)
    finally:
        group.shutdown()

