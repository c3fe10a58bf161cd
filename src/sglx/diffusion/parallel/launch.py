"""Start the ranks of a sequence-parallel `sglx generate`: one process per rank, each running the same job.

The parent checks what it can before any process starts (flag sizes, heads against the Ulysses degree, ranks
against GPUs), then spawns `sp` ranks with sglx.distributed.spawn (torchrun's environment, NVLink multicast
off, the first failure ends every rank and comes back as one line). Each rank joins torch.distributed (NCCL
on its own GPU, gloo on CPU) and runs the job. Under torchrun (`torchrun --nproc-per-node N -m sglx generate
--sp-size N ...`) every rank runs the job in place after `join_torchrun`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sglx.diffusion.parallel.degrees import check_devices
from sglx.diffusion.parallel.runtime import check_native_backend, requested_degrees
from sglx.errors import SglxError


def _asked(config: Any) -> bool:
    return any(v not in (None, 1) for v in (config.sp_size, config.ulysses_degree, config.ring_degree))


def _torchrun_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SglxError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def needs_launch(config: Any) -> bool:
    """True when the flags ask for more than one rank and no launcher (sglx's spawn, torchrun) started this one."""
    return _asked(config) and not dist.is_initialized() and _torchrun_world() <= 1


def join_torchrun(config: Any) -> None:
    """Under torchrun (WORLD_SIZE > 1 in the environment) with sequence-parallel flags: join the process group
    (NCCL on this rank's GPU, gloo on CPU); the engine then checks the world size against the split."""
    if _asked(config) and not dist.is_initialized() and _torchrun_world() > 1:
        from sglx.distributed.group import init_distributed

        init_distributed(device="cpu" if config.device == "cpu" else None)


def _heads(model_path: str | None) -> int | None:
    from sglx.diffusion.engine import resolve_diffusion_model_path

    path = resolve_diffusion_model_path(model_path)
    try:
        cfg = json.loads((path / "transformer" / "config.json").read_text(encoding="utf-8")) if path else {}
    except (OSError, json.JSONDecodeError):
        return None
    return cfg.get("num_attention_heads")


def launch_ranks(job: Callable[..., Any], config: Any, *args: Any, backend: str = "sglx") -> None:
    """Run `job(config, *args)` in every rank of the requested split; raise the first failure as one line."""
    from sglx.diffusion.engine import resolve_device
    from sglx.distributed.spawn import spawn_workers

    check_native_backend(config, backend)
    degrees = requested_degrees(config, _heads(config.model_path))
    device = resolve_device(config.device)
    if device.type == "cuda":
        check_devices(degrees, "cuda", torch.cuda.device_count())
    spawn_workers(_rank_main, degrees.size, (device.type, job, config, *args))


def _rank_main(rank: int, world: int, device_type: str, job: Callable[..., Any], config: Any, *args: Any) -> None:
    from sglx.distributed.group import destroy_distributed, init_distributed

    init_distributed(device="cpu" if device_type == "cpu" else None)
    try:
        job(config, *args)
    finally:
        destroy_distributed()
