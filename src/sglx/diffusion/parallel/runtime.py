"""What DiffusionEngine does differently under `--sp-size N`: check the split, wrap the attention backend,
shard the transformer's tokens, and leave the VAE and the output files to rank 0.

The engine runs in every rank (sglx generate spawns them, or torchrun starts them); each rank loads the same
weights, encodes the same prompt and draws the same noise; only the DiT's latent tokens are split. After the
last step every rank holds the whole latents (the output projection is gathered); rank 0 decodes them and
writes the file, the other ranks skip the VAE.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.diffusion.parallel.degrees import SPDegrees, check_devices, check_world, resolve_degrees
from sglx.diffusion.parallel.groups import SPGroups, sp_groups
from sglx.errors import SglxError


def check_native_backend(config: Any, backend: str) -> None:
    """Sequence parallelism lives in sglx's own pipelines, not in diffusers' (`--backend diffusers`)."""
    if backend != "sglx" and any(v not in (None, 1) for v in (config.sp_size, config.ulysses_degree,
                                                              config.ring_degree)):
        raise SglxError("--sp-size/--ulysses-degree/--ring-degree run on sglx's own pipelines; drop "
                        "--backend diffusers or the sequence-parallel flags")


def requested_degrees(config: Any, heads: int | None) -> SPDegrees:
    """The split asked for by the engine flags (SPDegrees(1, 1) when none is given)."""
    return resolve_degrees(config.sp_size, config.ulysses_degree, config.ring_degree, heads)


@dataclass
class SequenceParallelRuntime:
    degrees: SPDegrees
    groups: SPGroups
    handles: list[Any]

    @classmethod
    def start(cls, degrees: SPDegrees, device: torch.device) -> SequenceParallelRuntime:
        """Check the running process group against the split and build its Ulysses/ring groups."""
        if device.type == "cuda":
            check_devices(degrees, "cuda", torch.cuda.device_count())
        if not dist.is_initialized():
            raise SglxError(f"{degrees.describe()} needs one process per rank and none was started: use `sglx "
                            f"generate --sp-size {degrees.size}` (it starts them) or start every rank with torchrun "
                            f"--nproc-per-node {degrees.size}; `sglx serve --sp-size {degrees.size}` starts them too")
        check_world(degrees, dist.get_world_size())
        return cls(degrees, sp_groups(degrees), [])

    @property
    def is_driver(self) -> bool:
        return self.groups.rank == 0

    def wrap(self, backend: DiffusionAttentionBackend) -> DiffusionAttentionBackend:
        from sglx.diffusion.parallel.attention import SequenceParallelBackend

        return SequenceParallelBackend(backend, self.groups)

    def install(self, pipeline: Any) -> None:
        """Shard the pipeline's transformer(s); non-driver ranks skip the VAE decode."""
        from sglx.diffusion.parallel.sharding import shard_pipeline

        self.handles = shard_pipeline(pipeline, self.groups.rank, self.degrees.size)
        if not self.is_driver:
            pipeline.decode = types.MethodType(_skip_decode, pipeline)


def _skip_decode(self: Any, latents: torch.Tensor, *args: Any) -> torch.Tensor:
    """Ranks other than 0 write nothing, so they do not decode: an empty frame stack."""
    return torch.zeros(0, 1, 1, 3)
