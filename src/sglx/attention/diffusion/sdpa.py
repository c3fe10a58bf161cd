"""torch_sdpa: dense DiT attention through PyTorch's scaled_dot_product_attention (runs everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv
from sglx.attention.diffusion.sdpa_lse import sdpa_with_lse


class TorchSDPABackend(DiffusionAttentionBackend):
    name = "torch_sdpa"

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[2] != k.shape[2]
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    def forward_dense_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The SDPA kernels that expose the LSE (sdpa_lse.py): flash / memory-efficient on CUDA, flash on CPU."""
        check_qkv(q, k, v)
        return sdpa_with_lse(q, k, v, scale)
