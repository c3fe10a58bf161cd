"""What VSA, VMoBA and SVG2 share as backends: SDPA for their dense calls, config through the registry, and the
sequence check against the step's metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.routes import pick_route, run_block_sparse
from sglx.errors import SglxError


def validated(name: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Types and registry defaults (the registry's ConfigParams are the only place defaults live)."""
    from sglx.attention.config import validate_config
    from sglx.attention.registry import find

    spec = find(name, "diffusion", "dit")
    assert spec is not None, name
    return validate_config(spec, dict(config or {})).as_dict()


class SparseDiTBackend(TorchSDPABackend):
    """Dense calls (cross-attention, warm-up steps and layers, calls without metadata) run PyTorch SDPA; sparse
    calls go through `run`, which remembers the kernel route it took (and why) and the layout."""

    sparse = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.route: str | None = None  # routes.pick_route of the last sparse call: fa4, triton or reference
        self.route_why = ""
        self.last_layout: BlockSparseLayout | None = None

    @property
    def last_density(self) -> float | None:
        """Share of block pairs the last sparse call computed (None before one)."""
        return None if self.last_layout is None else self.last_layout.density()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
            scale: float | None) -> torch.Tensor:
        self.route, self.route_why = pick_route(q, layout)
        self.last_layout = layout
        return run_block_sparse(q, k, v, layout, scale, self.route)

    def check_sequence(self, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata) -> None:
        if q.shape[1] != meta.seq_len or k.shape[1] != meta.seq_len:
            raise SglxError(f"{self.name}: sequence of {q.shape[1]} tokens, but the step's grid {meta.grid} and "
                            f"{meta.text_tokens} text tokens make {meta.seq_len}")


__all__ = ["SparseDiTBackend", "validated"]
