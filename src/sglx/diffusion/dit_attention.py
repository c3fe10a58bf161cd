"""The one DiT attention layer: every attention call of a DiT goes through here to the selected backend.

Processors installed into a diffusers transformer (one per attention module) own their layer index and
hand q, k, v in [B, S, H, D] to `DiTAttention`; it reads the step's DiTAttnMetadata and calls the backend.
Self-attention (joint text+image attention in MM-DiTs) may be sparse; cross-attention to text is dense.
"""

from __future__ import annotations

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.metadata import current_metadata


class DiTAttention:
    """The attention of one DiT block, bound to the pipeline's backend and the block's index."""

    def __init__(self, backend: DiffusionAttentionBackend, layer: int) -> None:
        self.backend = backend
        self.layer = layer

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
        """Attention over the step's whole sequence (latent tokens plus joint text tokens)."""
        meta = current_metadata()
        if meta is not None and q.shape[1] != self.backend.local_seq_len(meta):
            raise RuntimeError(f"DiT layer {self.layer} got a sequence of {q.shape[1]} tokens but the step's "
                               f"metadata says {meta.seq_len} (grid {meta.grid} + {meta.text_tokens} text)")
        return self.backend.forward(q, k, v, scale=scale, meta=meta, layer=self.layer)

    def cross_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
        """Latent queries attending to text (or image-conditioning) keys: always dense."""
        return self.backend.forward_dense(q, k, v, scale=scale)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x0, x1), as Wan applies it; cos/sin [1, S, 1, D] per element.

    The same arithmetic as diffusers' Wan processor (x0*cos - x1*sin, x0*sin + x1*cos in the tables'
    precision) without its two strided scatter writes.
    """
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)
