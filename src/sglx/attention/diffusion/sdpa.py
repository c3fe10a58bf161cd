"""torch_sdpa: dense DiT attention through PyTorch's scaled_dot_product_attention (runs everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv


class TorchSDPABackend(DiffusionAttentionBackend):
    name = "torch_sdpa"

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[2] != k.shape[2]
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
