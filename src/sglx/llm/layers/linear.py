"""nn.Linear whose decode products stream the weights through sglx's own Triton kernels.

Same parameters and state-dict names as nn.Linear, so checkpoints load unchanged. For CUDA tensors in bf16/fp16
with fused kernels switched on (`SGLX_FUSED_KERNELS`):
- one row (a batch-1 decode step) goes to the CUDA-core GEMV (sglx.llm.kernels.gemv) for every projection, unless
  `SGLX_GEMV` is 0: in CUDA graphs on the H200 it was faster than cuBLAS at every Llama-3.1-8B and
  DeepSeek-V2-Lite projection shape (bench_gemv.py, session 23);
- up to MAX_ROWS rows go to the skinny GEMM where it was measured to help (layers built with skinny=True: o_proj
  and the LM head, see sglx.llm.kernels.skinny_gemm) unless `SGLX_SKINNY_GEMM` is 0.
Everything else, CPU included, is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglx.llm.kernels import env_switch, use_fused

SKINNY_ROWS = 16  # = sglx.llm.kernels.skinny_gemm.MAX_ROWS (that module imports triton)
_HALF = (torch.bfloat16, torch.float16)
_SKINNY_ON = env_switch("SGLX_SKINNY_GEMM")
_GEMV_ON = env_switch("SGLX_GEMV")


def gemv_weight_eligible(weight: torch.Tensor) -> bool:
    """Whether one-row products with this weight may go to the GEMV at all: switched on, a CUDA half-precision
    weight with contiguous rows, fused kernels on (norm folding asks this at load, before any row exists)."""
    return _GEMV_ON and weight.dtype in _HALF and weight.stride(-1) == 1 and use_fused(weight)


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether x @ weight^T (+ bias) may go to the one-row GEMV: a single row of the weight's dtype and device, a
    weight fit for it (`gemv_weight_eligible`), a bias of its dtype."""
    return (x.numel() == x.shape[-1] and x.dtype == weight.dtype and x.device == weight.device
            and (bias is None or bias.dtype == x.dtype) and gemv_weight_eligible(weight))


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T may go to the skinny GEMM: few CUDA half-precision rows, fused kernels on."""
    return (_SKINNY_ON and x.numel() <= SKINNY_ROWS * x.shape[-1] and x.dtype in _HALF
            and weight.dtype == x.dtype and weight.stride(-1) == 1 and use_fused(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, skinny: bool = True
           ) -> torch.Tensor:
    """F.linear, the GEMV for one CUDA half-precision row, or (skinny=True) the skinny GEMM for a few."""
    if gemv_eligible(x, weight, bias):
        from sglx.llm.kernels.gemv import gemv

        return gemv(x, weight, bias)[0]
    if skinny and skinny_eligible(x, weight):
        from sglx.llm.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`: one-row products take the GEMV; `skinny=True` layers (shapes where the skinny
    GEMM measured faster) take it for a few rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, skinny: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.skinny = skinny

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)
