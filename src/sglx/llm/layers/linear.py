"""nn.Linear whose few-row (decode) products stream the weights through sglx's skinny Triton GEMM.

Same parameters and state-dict names as nn.Linear, so checkpoints load unchanged. The skinny path runs
only where it was measured to help (layers built with skinny=True: o_proj and the LM head, see
sglx.llm.kernels.skinny_gemm) for CUDA tensors in bf16/fp16 with at most MAX_ROWS rows, fused kernels
switched on (`SGLX_FUSED_KERNELS`) and `SGLX_SKINNY_GEMM` not 0; everything else, CPU included, is
F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from sglx.llm.kernels import use_fused

SKINNY_ROWS = 16  # = sglx.llm.kernels.skinny_gemm.MAX_ROWS (that module imports triton)
_HALF = (torch.bfloat16, torch.float16)
_SKINNY_ON = os.environ.get("SGLX_SKINNY_GEMM", "1").strip().lower() not in ("0", "false", "off", "no")


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T may go to the skinny GEMM: few CUDA half-precision rows, fused kernels on."""
    return (_SKINNY_ON and x.numel() <= SKINNY_ROWS * x.shape[-1] and x.dtype in _HALF
            and weight.dtype == x.dtype and weight.stride(-1) == 1 and use_fused(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, skinny: bool = True
           ) -> torch.Tensor:
    """F.linear, or (skinny=True) the skinny GEMM for a decode-sized CUDA half-precision input."""
    if skinny and skinny_eligible(x, weight):
        from sglx.llm.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear; `skinny=True` layers (shapes where the skinny GEMM measured faster) use it for decode."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, skinny: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.skinny = skinny

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)
