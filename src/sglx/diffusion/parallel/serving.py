"""`sglx serve --sp-size N` for diffusion models: the server process is rank 0, N-1 follower processes serve it.

The generate path (launch.py) runs one batch in N equal processes; a server has to wait for requests that
arrive whenever they like. So rank 0 (the server's engine) starts the other ranks with sglx's own spawn, joins
the group with them, and hands each request to them before running it itself; every rank then runs the same
`DiffusionEngine.generate` (same weights, prompt, seed, scheduler) and the DiT's collectives pair up. Rank 0
decodes and answers; the followers skip the VAE.

Why requests travel over a multiprocessing queue and not a collective: an idle follower would sit in a
broadcast, and torch.distributed collectives time out (SGLX_DIST_TIMEOUT, 300 s), so a quiet server would
break itself. A queue can wait forever, and a follower whose parent dies exits on its own (spawn.py).

Cancelling: the server stops a job from its step callback, which only rank 0 runs. After every denoising step
rank 0 broadcasts one flag (keep going / stop), so all ranks leave the job at the same step and wait for the
next one. Any other failure on any rank breaks the group: the followers are ended, `failure` holds the one
line, and /health answers 503 with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglx.diffusion.pipelines.base import ProgressFn
from sglx.diffusion.request import DiffusionRequest, DiffusionResult
from sglx.distributed.spawn import WorkerError, one_line, start_workers
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

log = logging.getLogger("sglx.server")

STARTUP_TIMEOUT_S = 600.0  # every rank loads the whole model before the group is usable
STOP = None  # the command that tells a follower to leave


class _StopJob(Exception):
    """Rank 0 stopped the running job (the job was cancelled); followers drop it and wait for the next one."""


def wants_sequence_parallel(config: EngineConfig, backend: str) -> bool:
    """True when `sglx serve` was given more than one sequence-parallel rank."""
    from sglx.diffusion.parallel.launch import _asked, _heads
    from sglx.diffusion.parallel.runtime import check_native_backend, requested_degrees

    if not _asked(config):
        return False
    check_native_backend(config, backend)
    return requested_degrees(config, _heads(config.model_path)).active


class _StepAgreement:
    """The progress callback every rank runs after each step: rank 0's decision to stop reaches all ranks."""

    def __init__(self, device: torch.device, driver: bool, progress: ProgressFn | None = None) -> None:
        self.flag = torch.zeros(1, dtype=torch.int64, device=device)
        self.driver = driver
        self.progress = progress
        self.stopped = False  # rank 0: its own callback raised (the job was cancelled), the followers were told

    def __call__(self, done: int, total: int) -> None:
        raised: Exception | None = None
        if self.driver and self.progress is not None:
            try:
                self.progress(done, total)
            except Exception as exc:  # noqa: BLE001 - re-raised below, once the followers know
                raised = exc
        self.flag.fill_(int(raised is not None))
        dist.broadcast(self.flag, src=0)
        if raised is not None:
            self.stopped = True
            raise raised
        if int(self.flag.item()):
            raise _StopJob()


class SPServingEngine:
    """Rank 0 of a sequence-parallel group, with what the diffusion server uses of `DiffusionEngine`."""

    def __init__(self, config: EngineConfig, backend: str = "sglx") -> None:
        from sglx.diffusion.engine import resolve_device
        from sglx.diffusion.parallel.degrees import check_devices
        from sglx.diffusion.parallel.launch import _heads, _torchrun_world
        from sglx.diffusion.parallel.runtime import requested_degrees

        degrees = requested_degrees(config, _heads(config.model_path))
        if _torchrun_world() > 1:
            raise SglxError(f"`sglx serve --sp-size {degrees.size}` starts its own {degrees.size} ranks; run it once, "
                            "without torchrun")
        device = resolve_device(config.device)
        if device.type == "cuda":
            if device.index is not None:
                raise SglxError(f"--device {config.device} with {degrees.describe()}: rank r runs on cuda:r; use "
                                "--device cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)")
            check_devices(degrees, "cuda", torch.cuda.device_count())
        self.world_size = degrees.size
        self._failed = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._commands = [ctx.Queue() for _ in range(self.world_size - 1)]
        self.workers = start_workers(_follower_main, self.world_size,
                                     (device.type, config, backend, self._commands), on_failure=self._on_failure)
        try:
            self._join_group(device.type)
            from sglx.diffusion.engine import DiffusionEngine

            self.engine = DiffusionEngine(config, backend)
        except BaseException as exc:
            if not isinstance(exc, SglxError):  # bad input fails every rank alike: rank 0's own line is the one
                self._failed.wait(5.0)  # a follower's failure explains a collective error better than the error
            failure = self.workers.failure
            self._shutdown_workers(graceful=False)
            if failure is not None and not isinstance(exc, SglxError):
                raise failure from None
            raise

    # ---------------------------------------------------------------- what the server reads

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def defaults(self) -> Any:
        return self.engine.defaults

    @property
    def info(self) -> dict[str, Any]:
        return self.engine.info

    @property
    def failure(self) -> WorkerError | None:
        """The first failure of the group (one line), or None while every rank serves."""
        return self.workers.failure

    def resolve(self, request: DiffusionRequest) -> Any:
        return self.engine.resolve(request)

    # ---------------------------------------------------------------- running

    def generate(self, request: DiffusionRequest, progress: ProgressFn | None = None) -> DiffusionResult:
        """Check the request here, hand it to every follower, run it; all ranks stop at the same step."""
        self.engine.resolve(request)  # bad input is a 400 before any rank starts
        with self._lock:
            self._check()
            for queue in self._commands:
                queue.put(request)
            agreement = _StepAgreement(self.engine.device, True, progress)
            try:
                return self.engine.generate(request, agreement)
            except Exception as exc:
                if agreement.stopped:  # cancelled between steps: every rank left the job, the group is intact
                    raise
                self._failed.wait(2.0)  # a follower's death shows up here first as a collective error
                failure = self.workers.failure
                if failure is not None:
                    raise failure from None
                self.workers.stop_with_failure(0, f"{one_line(exc)} (the sequence-parallel group was stopped)")
                raise

    def _check(self) -> None:
        failure = self.workers.failure
        if failure is not None:
            raise failure
        if self._closed:
            raise SglxError("the sequence-parallel ranks were shut down")

    # ---------------------------------------------------------------- start and stop

    def _join_group(self, device_type: str) -> None:
        self.workers.join_as_driver(device="cpu" if device_type == "cpu" else None,
                                    what="sequence-parallel ranks", timeout_s=STARTUP_TIMEOUT_S)

    def _on_failure(self, error: WorkerError) -> None:
        log.error("%s", error)
        self._failed.set()
        if dist.is_initialized() and dist.get_backend() == "nccl":  # gloo fails on its own when a peer is gone;
            with contextlib.suppress(Exception):  # NCCL would wait for the dead rank until its timeout
                from torch.distributed import distributed_c10d

                abort = getattr(distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    abort()

    def _shutdown_workers(self, graceful: bool = True) -> None:
        """graceful: the followers serve (tell them to leave and wait for them); else they are ended at once."""
        if graceful and self.workers.failure is None:
            for queue in self._commands:
                with contextlib.suppress(Exception):
                    queue.put(STOP)
            with contextlib.suppress(Exception):
                self.workers.wait(30.0)
        self.workers.shutdown()
        for queue in self._commands:
            with contextlib.suppress(Exception):
                queue.close()
                queue.join_thread()
        from sglx.distributed.group import destroy_distributed

        with contextlib.suppress(Exception):
            destroy_distributed()

    def close(self) -> None:
        """Tell the followers to leave, wait for them briefly, end what is left, leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._shutdown_workers()
        self.engine.close()

    def __enter__(self) -> SPServingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _follower_main(rank: int, world: int, device_type: str, config: EngineConfig, backend: str,
                   commands: list[Any]) -> int:
    """A follower rank: join the group, load the same engine, then run every request rank 0 hands over."""
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.distributed.group import destroy_distributed, init_distributed

    init_distributed(device="cpu" if device_type == "cpu" else None)
    engine = DiffusionEngine(config, backend)
    step = _StepAgreement(engine.device, False)
    queue = commands[rank - 1]
    served = 0
    while True:
        request = queue.get()
        if request is STOP:
            break
        with contextlib.suppress(_StopJob):
            engine.generate(request, step)
            served += 1
    engine.close()
    destroy_distributed()
    return served
