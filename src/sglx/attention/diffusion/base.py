"""The contract of a diffusion (DiT) attention backend: dense or sparse attention over [B, S, H, D]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shapes every backend accepts: q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], Hq a multiple of Hkv."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected q, k, v of shape [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k, v do not agree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")


class DiffusionAttentionBackend(ABC):
    """One instance per pipeline; `forward` is called by every DiT attention layer.

    `meta` is the step's DiTAttnMetadata (None when a module is called outside a pipeline step) and
    `layer` the index of the calling DiT block. Dense backends ignore both; sparse backends read them to
    build their block lists and fall back to `forward_dense` where their pattern does not apply (cross
    attention, warm-up steps, full layers).
    """

    name: ClassVar[str] = "base"
    sparse: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    @abstractmethod
    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        """Full non-causal attention: q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] -> [B, Sq, Hq, D]."""

    def forward_dense_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_dense` plus the softmax log-sum-exp [B, Hq, Sq] (float32; float64 for float64 inputs).

        Ring attention merges partial results by it. Only backends whose registry features declare
        `lse=True` implement it (their kernel returns the LSE); the others raise here."""
        raise NotImplementedError(f"attention backend {self.name} returns no log-sum-exp")

    def local_seq_len(self, meta: DiTAttnMetadata) -> int:
        """Tokens of the step's sequence that this process passes in: all of them (sequence-parallel wrappers,
        sglx.diffusion.parallel, take a shard)."""
        return meta.seq_len

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        """Self-attention over the step's sequence; dense backends run `forward_dense`."""
        return self.forward_dense(q, k, v, scale=scale)
