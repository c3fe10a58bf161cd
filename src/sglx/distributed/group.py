"""One torch.distributed process group per process: who am I, how many are we, which backend, which device.

sglx writes no communication layer of its own: this module only starts torch.distributed (gloo on CPU,
NCCL on CUDA) from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or from
explicit arguments, and hands back a small frozen `DistContext` that layers use for their collectives.

NVLink multicast (NCCL NVLS, PyTorch symmetric-memory multicast, NVSHMEM NVLS) is switched off before any
group starts and nothing here calls what would enable it: on shared multi-GPU hosts a program using it can
put every GPU of the host out of service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sglx.errors import SglxError

# Environment variables that keep NVLink multicast off in NCCL, PyTorch and NVSHMEM. Always forced.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

DEFAULT_TIMEOUT_S = 300.0
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class DistributedInitError(SglxError):
    """torch.distributed could not start (bad rank/world size, rendezvous failed, backend missing)."""


def disable_nvlink_multicast(environ: dict[str, str] | None = None) -> None:
    """Set the variables that keep NVLink multicast off (in `environ`, default this process's environment)."""
    env = os.environ if environ is None else environ
    env.update(MULTICAST_OFF_ENV)


@dataclass(frozen=True)
class DistContext:
    """This process's place in the group: its rank, the group size, the backend and the device it computes on.

    `world_size == 1` is a valid context with no process group: every collective is then the identity, so
    single-device code paths need no special case.
    """

    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "none" (world_size 1, no group)
    device: torch.device

    @property
    def is_driver(self) -> bool:
        """Rank 0 receives requests, prints and returns results; the other ranks follow it."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when a process group exists (world_size > 1)."""
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over all ranks in place ("sum", "min" or "max") and return it."""
        if self.active:
            dist.all_reduce(tensor, op=_REDUCE_OPS[op])
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` (same shape on all ranks) along `dim`, in rank order (one collective)."""
        if not self.active:
            return tensor
        tensor = tensor.contiguous()
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        _all_gather_single(out, tensor)  # rank-major along dim 0 (the layout gloo and NCCL both take)
        dim = dim % tensor.dim()
        if dim == 0:
            return out
        out = out.reshape(self.world_size, *tensor.shape)
        return out.movedim(0, dim).flatten(dim, dim + 1)  # [.., ranks, d_dim, ..] -> [.., ranks * d_dim, ..]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` on every rank with rank `src`'s values (in place) and return it."""
        if self.active:
            dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: object = None, src: int = 0) -> object:
        """Send a picklable object from rank `src` to every rank; other ranks pass anything and get it back."""
        if not self.active:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if self.active:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()


def _all_gather_single(out: torch.Tensor, tensor: torch.Tensor) -> None:
    """all_gather_single (torch >= 2.12) or its older name all_gather_into_tensor: one collective into `out`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, tensor)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise DistributedInitError(f"environment variable {name}={value!r} is not an integer") from exc


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _pick_device(device: torch.device | str | None, local_rank: int) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    backend: str | None = None,
    init_method: str | None = None,
    device: torch.device | str | None = None,
    local_rank: int | None = None,
    timeout_s: float | None = None,
) -> DistContext:
    """Join (or, for world_size 1, skip) the process group and return this process's `DistContext`.

    rank / world_size / local_rank default to torchrun's RANK / WORLD_SIZE / LOCAL_RANK (1 process when
    unset); init_method defaults to torchrun's MASTER_ADDR:MASTER_PORT rendezvous ("env://"). The backend
    defaults to NCCL when the device is CUDA, else gloo. `device` defaults to cuda:LOCAL_RANK when CUDA is
    available, else CPU. Collectives time out after `timeout_s` (default SGLX_DIST_TIMEOUT or 300 s) so a
    dead peer ends in an error instead of a hang. Any failure is one `DistributedInitError` line.
    """
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if local_rank is None:
        env_local = _env_int("LOCAL_RANK")
        local_rank = rank if env_local is None else env_local
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedInitError(
            f"cannot start torch.distributed: rank {rank} is not in 0..{world_size - 1} (world size {world_size})"
        )
    dev = _pick_device(device, local_rank)
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DistributedInitError(
                f"rank {rank} asked for {dev} but this machine has {count} CUDA device(s); "
                f"use at most {count} ranks per machine"
            )
        torch.cuda.set_device(dev)
    if world_size == 1:
        return DistContext(rank=0, world_size=1, backend="none", device=dev)

    backend = backend or default_backend(dev)
    if backend == "nccl" and dev.type != "cuda":
        raise DistributedInitError(f"backend nccl needs CUDA devices but rank {rank} runs on {dev}; use gloo")
    if backend == "nccl" and not dist.is_nccl_available():
        raise DistributedInitError("backend nccl is not available in this torch build; use gloo or a CUDA torch")
    if backend == "gloo" and not dist.is_gloo_available():
        raise DistributedInitError("backend gloo is not available in this torch build")
    disable_nvlink_multicast()
    if init_method is None:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
        if missing:
            raise DistributedInitError(
                f"cannot start torch.distributed for {world_size} ranks: {' and '.join(missing)} not set; "
                "launch with torchrun, sglx's own spawn, or pass init_method='tcp://HOST:PORT'"
            )
        init_method = "env://"
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("SGLX_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)))
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedInitError(
                f"torch.distributed is already running as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"not rank {rank} of {world_size}"
            )
        return DistContext(rank=rank, world_size=world_size, backend=dist.get_backend(), device=dev)
    try:
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )
    except Exception as exc:  # noqa: BLE001 - every rendezvous/backend failure becomes one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedInitError(
            f"could not start torch.distributed ({backend}, rank {rank} of {world_size}, {init_method}): {reason}"
        ) from exc
    return DistContext(rank=rank, world_size=world_size, backend=backend, device=dev)


def destroy_distributed() -> None:
    """Leave the process group if one is running (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
