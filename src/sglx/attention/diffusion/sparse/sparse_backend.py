"""What VSA, VMoBA and SVG2 share as backends: SDPA for their dense calls, config through the registry, and the
sequence check against the step's metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.errors import SglxError


def validated(name: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Types and registry defaults (the registry's ConfigParams are the only place defaults live)."""
    from sglx.attention.config import validate_config
    from sglx.attention.registry import find

    spec = find(name, "diffusion", "dit")
    assert spec is not None, name
    return validate_config(spec, dict(config or {})).as_dict()


class SparseDiTBackend(TorchSDPABackend):
    """Dense calls (cross-attention, warm-up steps and layers, calls without metadata) run PyTorch SDPA."""

    sparse = True

    def check_sequence(self, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata) -> None:
        if q.shape[1] != meta.seq_len or k.shape[1] != meta.seq_len:
            raise SglxError(f"{self.name}: sequence of {q.shape[1]} tokens, but the step's grid {meta.grid} and "
                            f"{meta.text_tokens} text tokens make {meta.seq_len}")


__all__ = ["SparseDiTBackend", "validated"]
