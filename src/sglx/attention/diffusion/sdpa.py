"""torch_sdpa: dense DiT attention through PyTorch's scaled_dot_product_attention (runs everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, DiTAttentionContext


class TorchSDPABackend(DiffusionAttentionBackend):
    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                scale: float | None = None, ctx: DiTAttentionContext | None = None) -> torch.Tensor:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"expected q, k, v of shape [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
        hq, hkv = q.shape[2], k.shape[2]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if hq != hkv:
            kt = kt.repeat_interleave(hq // hkv, dim=1)
            vt = vt.repeat_interleave(hq // hkv, dim=1)
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
        return out.transpose(1, 2)
