"""The contract of a diffusion (DiT) attention backend: dense or sparse attention over [B, S, H, D]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class DiTAttentionContext:
    """Per-call facts sparse backends need: the latent (T, H, W) token grid and the denoising step."""

    grid: tuple[int, int, int] | None = None
    step: int | None = None
    layer: int | None = None


class DiffusionAttentionBackend(ABC):
    name: ClassVar[str] = "base"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                scale: float | None = None, ctx: DiTAttentionContext | None = None) -> torch.Tensor:
        """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D] with Hq a multiple of Hkv -> [B, Sq, Hq, D]."""
