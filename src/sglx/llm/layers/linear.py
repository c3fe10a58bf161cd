"""nn.Linear whose few-row (decode) products stream the weights through sglx's skinny Triton GEMM.

Same parameters and state-dict names as nn.Linear, so checkpoints load unchanged. The skinny path runs
only where it was measured to help: CUDA tensors in bf16/fp16 with at most MAX_ROWS rows, fused
kernels switched on (`SGLX_FUSED_KERNELS`) and `SGLX_SKINNY_GEMM` not 0; everything else, CPU
included, is F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from sglx.llm.kernels import use_fused

SKINNY_ROWS = 16  # = sglx.llm.kernels.skinny_gemm.MAX_ROWS (that module imports triton)
_HALF = (torch.bfloat16, torch.float16)
# smallest weight (MB) sent to the skinny GEMM (default: all); SGLX_SKINNY_GEMM=0 turns it off
# (H100 profile of a Llama-3.1-8B batch-1 step: every projection skinny 5.37 ms of GEMM, cuBLAS 5.53)
_SKINNY_MIN_MB = {"0": None, "off": None, "false": None, "no": None, "all": 0.0}.get(
    os.environ.get("SGLX_SKINNY_GEMM", "").strip().lower(), 0.0)


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T goes to the skinny GEMM (x's last dim may be 2K for a fused activation)."""
    return (_SKINNY_MIN_MB is not None and weight.numel() * weight.element_size() >= _SKINNY_MIN_MB * 2**20
            and x.numel() <= SKINNY_ROWS * x.shape[-1] and x.dtype in _HALF and weight.dtype == x.dtype
            and weight.stride(-1) == 1 and use_fused(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the skinny GEMM for a decode-sized CUDA half-precision input."""
    if skinny_eligible(x, weight):
        from sglx.llm.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
