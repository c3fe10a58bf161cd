"""Tensor-parallel serving: one scheduler in the driver process (rank 0) drives N-1 worker processes.

Design (SGLang runs one scheduler per TP rank, rank 0 receiving requests and broadcasting them, and every
rank scheduling the same way). sglx keeps ONE scheduler, in rank 0: before each forward the driver
broadcasts the step itself (mode, token ids, positions, request rows, KV slots, and each request's
req_to_token row up to its length), and every worker writes those rows into its own req_to_token table and
runs the same forward on its own weight shards, KV pool (its local heads) and attention backend. Why:

* nothing else has to be deterministic across processes: radix-cache eviction, retraction, chunking,
  request arrival times and aborts all happen in one place, so ranks cannot drift apart;
* anything that writes the request table (the scheduler, the radix cache, `sglx bench one-batch`'s static
  batches) works unchanged, because workers copy the rows instead of recomputing them;
* sampling runs once, in the driver, on the full logits (the LM head all-gathers the vocabulary), so every
  rank's "sampled" token is by construction the same one: workers never sample.

The cost is one small broadcast per step (rows are int32 slot ids; a decode step of 64 requests at 8k
context is 2 MB, microseconds over NVLink), plus the pickled header.

Idle: a worker waiting for the next step sits in a broadcast, and collectives time out (SGLX_DIST_TIMEOUT,
300 s): a server with no requests for that long would break its own group. So after a few idle seconds the
driver broadcasts PARK (with the park's key); parked workers wait for that key in the process group's own
key-value store, with no timeout, and the next step first sets it to WAKE (shutdown sets LEAVE). The store is
the one every launch already has (rank 0's TCPStore under sglx's spawn, the agent's under torchrun, the
MASTER_ADDR:MASTER_PORT one under any RANK/WORLD_SIZE launcher), so ranks started by torchrun park the same way
as sglx's own. A parked worker whose driver dies sees the store's connection close (or is ended by torchrun).

Failure: a worker that raises reports one line and exits; the driver's watcher terminates every other
worker and aborts the process group, so the driver's pending collective fails, the running requests end
with that line and the engine refuses new work. A driver that dies takes its workers with it (they watch
their parent). Nothing is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from sglx.distributed.group import DistContext, destroy_distributed, init_distributed
from sglx.distributed.spawn import WorkerError, WorkerGroup, one_line, start_workers
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig
from sglx.llm.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglx.llm.model_config import ModelConfig
    from sglx.llm.model_runner import ModelRunner
    from sglx.platform import PlatformSnapshot

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # workers load their shards while the driver loads its own
PARK_AFTER_S = 5.0  # idle seconds before the workers are parked (at most a quarter of the collective timeout)
WAKE, LEAVE = b"wake", b"leave"  # what a parked worker reads under its park's key
PARKED_WAIT = timedelta(days=3650)  # a parked worker waits for its key with no practical limit
LEFT_WAIT_S = 30.0  # how long shutdown waits for parked workers to read LEAVE before leaving the group


def validate_tp(config: EngineConfig, model_config: ModelConfig) -> None:
    """One SglxError line when `--tp-size` cannot run this model on this machine (before any process starts)."""
    from sglx.llm.layers.parallel import check_tp_supported
    from sglx.llm.model_runner import resolve_device

    tp = config.tp_size
    if tp == 1:
        return
    check_tp_supported(model_config, tp)
    if config.device.startswith("cuda:"):
        raise SglxError(f"--device {config.device} with --tp-size {tp}: rank r runs on cuda:r; use --device cuda "
                        "(and CUDA_VISIBLE_DEVICES to choose the GPUs)")
    device = resolve_device(config.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if tp > count:
            raise SglxError(f"--tp-size {tp} needs {tp} GPUs but this machine has {count}; "
                            f"use --tp-size {count} or fewer" + ("" if count else ", or --device cpu"))


def build_model_runner(config: EngineConfig) -> ModelRunner:
    """A ModelRunner; with tp_size > 1 it is rank 0 of a group whose other ranks run in worker processes."""
    from sglx.llm.model_config import load_model_config
    from sglx.llm.model_runner import ModelRunner

    if config.dp_size > 1:
        raise SglxError(f"--dp-size {config.dp_size} runs replicas behind `sglx serve`; one engine (generate, "
                        "bench, Engine) is one replica: drop --dp-size")
    launched_rank = torchrun_rank(config)
    if config.tp_size == 1:
        return ModelRunner(config)
    validate_tp(config, load_model_config(config.resolved_model_path()))
    if launched_rank is not None and launched_rank > 0:  # torchrun started this rank: serve rank 0, then leave
        _worker_main(launched_rank, config.tp_size, config, None)  # parks like a spawned worker when idle
        raise SystemExit(0)
    driver = TPDriver(config, spawn=launched_rank is None)
    try:
        runner = driver.build_runner()
    except BaseException:
        failure = driver.wait_for_failure(5.0)
        driver.shutdown()
        if failure is not None:
            raise failure from None
        raise
    return runner


def torchrun_rank(config: EngineConfig) -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE > 1) started it, else None.

    Under such a launcher every rank runs the same command; rank 0 becomes the driver and the others serve it.
    """
    world, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if world is None or rank is None or world.strip() in ("", "1"):
        return None
    try:
        world_size, rank_id = int(world), int(rank)
    except ValueError:
        raise SglxError(f"RANK={rank!r} and WORLD_SIZE={world!r} must be integers") from None
    if world_size != config.tp_size:
        raise SglxError(f"this process was launched as rank {rank_id} of WORLD_SIZE={world_size} (torchrun), but "
                        f"--tp-size is {config.tp_size}; pass --tp-size {world_size}")
    return rank_id


class _LauncherWorkers:
    """The worker ranks when an outside launcher (torchrun) started them: it, not sglx, watches and ends them."""

    failure: WorkerError | None = None

    def stop_with_failure(self, rank: int, message: str) -> None:
        if self.failure is None:
            self.failure = WorkerError(f"rank {rank} failed: {message}", rank)

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        return []

    def shutdown(self) -> None:
        return None


class TPDriver:
    """Rank 0: starts the workers (unless torchrun did), joins the group, and sends each step to the workers
    before computing it."""

    def __init__(self, config: EngineConfig, spawn: bool = True) -> None:
        self.config = config
        self.world_size = config.tp_size
        self._failed = threading.Event()
        self._closed = False
        self.runner: ModelRunner | None = None
        from sglx import platform

        self.platform = platform.current()  # probed once, here; the workers select from the same snapshot
        self._step_lock = threading.Lock()  # one step (or park) on the wire at a time
        self._parked = False
        self._parks = 0  # parks so far: each has its own key, so a stale wake-up can never wake a later park
        self._park_id = secrets.randbits(62)  # this driver's keys, apart from any earlier group's in the same store
        self._last_step = time.monotonic()
        if not spawn:
            self.workers: WorkerGroup | _LauncherWorkers = _LauncherWorkers()
            self.ctx = init_distributed(0, self.world_size, device=_device_for(config, 0))
            self.ctx.broadcast_object(self.platform)  # the launcher's ranks select from rank 0's snapshot
            return
        self.workers = start_workers(_worker_main, self.world_size, (config, self.platform),
                                     on_failure=self._on_failure)
        self.ctx = self._join_group()

    # ---------------------------------------------------------------- startup

    def _join_group(self) -> DistContext:
        """Rank 0 joins the group; any failure on the way ends the workers too."""
        workers = self.workers
        assert isinstance(workers, WorkerGroup)
        try:
            return workers.join_as_driver(device=_device_for(self.config, 0), what="tensor-parallel workers",
                                          timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            workers.shutdown()
            raise

    def build_runner(self) -> ModelRunner:
        from sglx.llm.model_runner import ModelRunner

        runner = ModelRunner(self.config, dist=self.ctx, platform_snapshot=self.platform)
        runner.tp_driver = self
        self.runner = runner
        threading.Thread(target=self._park_when_idle, name="sglx-tp-park", daemon=True).start()
        return runner

    # ---------------------------------------------------------------- steps

    def forward(self, batch: ForwardBatch, compute: Callable[[ForwardBatch], torch.Tensor]) -> torch.Tensor:
        """One step on every rank: send it to the workers, then `compute` it here (ModelRunner.forward).

        If this rank fails after the workers started the step, their collectives can never match again:
        the group is stopped and every later step raises that failure."""
        with self._step_lock:
            self._unpark()
            self.send_step(batch)
            try:
                return compute(batch)
            except Exception as exc:
                failure = self.wait_for_failure(1.0)  # a worker's death shows up here as a collective error
                if failure is not None:
                    raise failure from None
                self.workers.stop_with_failure(0, f"{one_line(exc)} (the tensor-parallel group was stopped)")
                raise
            finally:
                self._last_step = time.monotonic()

    # ---------------------------------------------------------------- idle

    def _unpark(self) -> None:
        if self._parked:
            _group_store().set(_park_key(self._park_id, self._parks), WAKE)
            self._parked = False

    def _park_when_idle(self) -> None:
        """Park the workers once no step was sent for PARK_AFTER_S (or a quarter of the collective timeout)."""
        from sglx.distributed.group import DEFAULT_TIMEOUT_S

        timeout = float(os.environ.get("SGLX_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        after = min(PARK_AFTER_S, timeout / 4)
        while not self._closed and self.workers.failure is None:
            time.sleep(min(1.0, after / 4))
            if self._parked or time.monotonic() - self._last_step < after:
                continue
            if not self._step_lock.acquire(blocking=False):  # a step is running
                continue
            try:
                if not self._parked and not self._closed and self.workers.failure is None and \
                        time.monotonic() - self._last_step >= after:
                    self._parks += 1
                    _broadcast_header(self.ctx, PARK, self._parks, self._park_id)
                    self._parked = True
            except Exception:  # noqa: BLE001 - a broken group is reported by the workers' watcher
                return
            finally:
                self._step_lock.release()

    def send_step(self, batch: ForwardBatch) -> None:
        """Broadcast the step to the workers (rank 0, right before its own forward)."""
        self.check()
        try:
            _broadcast_batch(self.ctx, batch)
        except Exception:
            failure = self.wait_for_failure(5.0)
            if failure is not None:
                raise failure from None
            raise

    def check(self) -> None:
        """Raise the first worker failure (a broken group cannot run another step)."""
        failure = self.workers.failure
        if failure is not None:
            raise failure
        if self._closed:
            raise SglxError("the tensor-parallel workers were shut down")

    def wait_for_failure(self, timeout_s: float) -> WorkerError | None:
        """The worker failure behind a collective error (its report may arrive a moment later)."""
        self._failed.wait(timeout_s)
        return self.workers.failure

    def _on_failure(self, error: WorkerError) -> None:
        log.info("%s", error)  # the caller raises it as the one line users see; this is for server logs
        self._failed.set()
        if getattr(self, "ctx", None) is not None and self.ctx.backend == "nccl":
            _abort_group()  # NCCL would wait for the dead rank until its timeout; gloo fails on its own

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Tell the workers to stop, wait briefly, terminate what is left, leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "ctx", None) is not None and self.workers.failure is None:
            locked = self._step_lock.acquire(timeout=30.0)
            try:
                with contextlib.suppress(Exception):
                    if self._parked:
                        self._release_parked()
                    else:
                        _broadcast_stop(self.ctx)
                    self.workers.wait(30.0)
            finally:
                if locked:
                    self._step_lock.release()
        self.workers.shutdown()
        with contextlib.suppress(Exception):
            destroy_distributed()

    def _release_parked(self) -> None:
        """Set the park's key to LEAVE and wait (briefly) until every worker read it: under torchrun-style
        launches rank 0 hosts the store, which leaving the group closes."""
        store, key = _group_store(), _park_key(self._park_id, self._parks)
        store.set(key, LEAVE)
        deadline = time.monotonic() + LEFT_WAIT_S
        while store.add(key + "/left", 0) < self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)


def _group_store() -> Any:
    """The default process group's key-value store (torch keeps it; every launch method creates one)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _park_key(park_id: int, park: int) -> str:
    return f"sglx/tp/park/{park_id}/{park}"


def _wait_parked(key: str) -> bytes:
    """A parked worker: wait outside any collective until the driver sets `key`; WAKE or LEAVE."""
    store = _group_store()
    store.wait([key], PARKED_WAIT)
    action = bytes(store.get(key))
    if action == LEAVE:
        store.add(key + "/left", 1)  # the driver may now close the store
    return action


def _device_for(config: EngineConfig, rank: int) -> torch.device:
    """cuda:LOCAL_RANK (torchrun) or cuda:rank (sglx's spawn, one machine) on CUDA, else the CPU."""
    from sglx.llm.model_runner import resolve_device

    device = resolve_device(config.device)
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local else rank) if device.type == "cuda" else device


def _abort_group() -> None:
    """Abort the NCCL communicators so collectives blocked on a dead rank return an error instead of hanging."""
    with contextlib.suppress(Exception):
        from torch.distributed import distributed_c10d

        abort = getattr(distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()


# -------------------------------------------------------------------- the step on the wire


_MODES = list(ForwardMode)
_HEADER = 5  # mode, tokens, batch size, row width, return_all_logits
STOP = -1  # the mode value that tells workers to leave
PARK = -2  # the mode value that tells workers to wait in the store (the driver is idle); then park number, id


def _broadcast_batch(ctx: DistContext, batch: ForwardBatch) -> None:
    """Two broadcasts per step: a fixed-size header, then every integer the step needs in one int64 buffer."""
    table = batch.req_to_token_pool.req_to_token
    bs, width = batch.batch_size, max(batch.seq_lens_cpu, default=0)
    header = [_MODES.index(batch.mode), batch.num_tokens, bs, width, int(batch.return_all_logits)]
    # non_blocking host-to-device copies: rank 0 must not wait for the step in flight (overlap scheduling)
    ctx.broadcast(torch.tensor(header, dtype=torch.int64).to(ctx.device, non_blocking=True))
    rows = table[batch.req_pool_indices.to(table.device), :width]
    lens = batch.extend_seq_lens_cpu or [0] * bs
    prefix = batch.extend_prefix_lens_cpu or [0] * bs
    parts = [batch.input_ids, batch.positions, batch.req_pool_indices, batch.out_cache_loc,
             torch.tensor([*batch.seq_lens_cpu, *lens, *prefix], dtype=torch.int64), rows.reshape(-1)]
    ctx.broadcast(torch.cat([p.to(device=ctx.device, dtype=torch.int64, non_blocking=True) for p in parts]))


def _broadcast_header(ctx: DistContext, mode: int, *fields: int) -> None:
    header = [mode, *fields] + [0] * (_HEADER - 1 - len(fields))
    ctx.broadcast(torch.tensor(header, dtype=torch.int64, device=ctx.device))


def _broadcast_stop(ctx: DistContext) -> None:
    _broadcast_header(ctx, STOP)


def _receive_batch(ctx: DistContext, runner: ModelRunner) -> ForwardBatch | str | None:
    """The next step; None when the driver says STOP; the park's store key when it says PARK."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=ctx.device)
    ctx.broadcast(header)
    mode, t, bs, width, all_logits = header.tolist()
    if mode == STOP:
        return None
    if mode == PARK:  # header: PARK, park number, the driver's park id
        return _park_key(park_id=bs, park=t)
    buf = torch.empty(3 * t + 4 * bs + bs * width, dtype=torch.int64, device=ctx.device)
    ctx.broadcast(buf)
    input_ids, positions, req_idx, out_loc, lens, rows = buf.split([t, t, bs, t, 3 * bs, bs * width])
    seq_lens, extend_lens, prefix_lens = (x.tolist() for x in lens.cpu().split(bs))
    table = runner.req_to_token_pool.req_to_token
    if width:
        table[req_idx.to(table.device), :width] = rows.reshape(bs, width).to(table.device, table.dtype)
    device, fmode = runner.device, _MODES[mode]
    return ForwardBatch(
        mode=fmode, input_ids=input_ids.to(device), positions=positions.to(device),
        req_pool_indices=req_idx.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        out_cache_loc=out_loc.to(device), req_to_token_pool=runner.req_to_token_pool,
        token_kv_pool=runner.token_kv_pool, seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=extend_lens if fmode.is_extend else [],
        extend_prefix_lens_cpu=prefix_lens if fmode.is_extend else [], return_all_logits=bool(all_logits))


def _worker_main(rank: int, world_size: int, config: EngineConfig, platform: PlatformSnapshot | None) -> int:
    """A worker rank (sglx's spawn or torchrun): join the group, build its shard of the model, then run every
    step rank 0 sends, waiting in the group's store while the driver has it parked.

    platform: rank 0's snapshot of the machine; None (torchrun) receives it from rank 0 after joining."""
    from sglx.llm.model_runner import ModelRunner

    if _device_for(config, rank).type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    ctx = init_distributed(rank, world_size, device=_device_for(config, rank))
    if platform is None:
        platform = ctx.broadcast_object(None)  # type: ignore[assignment]
    runner = ModelRunner(config, dist=ctx, platform_snapshot=platform)
    steps = 0
    with torch.inference_mode():
        while True:
            batch = _receive_batch(ctx, runner)
            if batch is None:
                break
            if isinstance(batch, str):  # PARK: the driver is idle; wait outside any collective
                if _wait_parked(batch) == LEAVE:
                    break
                continue
            runner.forward(batch)
            steps += 1
    runner.release_memory()
    destroy_distributed()
    return steps
