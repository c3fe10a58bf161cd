"""Multi-process execution on torch.distributed: process groups (group.py) and sglx's own launcher (spawn.py).

Stable API for the rest of sglx (tensor-parallel LLMs, sequence-parallel DiT attention):

* `init_distributed(rank=None, world_size=None, *, backend=None, init_method=None, device=None) -> DistContext`
  (torchrun's environment when arguments are omitted; gloo on CPU, NCCL on CUDA; NVLink multicast off)
* `DistContext`: rank, world_size, backend, device, is_driver, all_reduce, all_gather, broadcast,
  broadcast_object, barrier (identity operations when world_size is 1)
* `destroy_distributed()`
* `spawn_workers(fn, world_size, args=(), *, timeout_s=None) -> list` runs `fn(rank, world_size, *args)`
  in fresh processes; `start_workers(...) -> WorkerGroup` starts background ranks for a driver process
* errors: `DistributedInitError`, `WorkerError` (both SglxError: one line, no traceback in the CLI)
"""

from sglx.distributed.group import (
    DistContext,
    DistributedInitError,
    default_backend,
    destroy_distributed,
    disable_nvlink_multicast,
    init_distributed,
)
from sglx.distributed.spawn import WorkerError, WorkerGroup, find_free_port, spawn_workers, start_workers

__all__ = ["DistContext", "DistributedInitError", "WorkerError", "WorkerGroup", "default_backend",
           "destroy_distributed", "disable_nvlink_multicast", "find_free_port", "init_distributed",
           "spawn_workers", "start_workers"]
