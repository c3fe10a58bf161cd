"""RMSNorm, computed in float32 and cast back exactly where Hugging Face does, so logits match bit-closely.

On CUDA tensors (when triton imports) one fused Triton kernel does the whole norm, and `add_and_norm`
also folds in the residual add that precedes every norm of a decoder layer; CPU runs the torch code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglx.llm.kernels import use_fused


@dataclass(frozen=True)
class UnsummedRows:
    """A residual delta still to be summed: float32 rows [T * top_k, H], token t's delta the sum of rows
    t * top_k .. t * top_k + top_k - 1 rounded to the model dtype (a MoE layer's weighted expert outputs).
    `RMSNorm.add_and_norm` sums them inside its kernel, so the sum costs no launch of its own."""

    rows: torch.Tensor
    top_k: int

    def summed(self, dtype: torch.dtype) -> torch.Tensor:
        """The delta as one tensor [T, H] (the unfused path)."""
        return self.rows.view(-1, self.top_k, self.rows.shape[-1]).sum(dim=1).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x) and self.weight.dtype == x.dtype:
            from sglx.llm.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return self._torch(x)

    def add_and_norm(self, delta: torch.Tensor | UnsummedRows,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta): the residual stream update and the next norm at once."""
        if isinstance(delta, UnsummedRows):
            if use_fused(residual) and self.weight.dtype == residual.dtype:
                from sglx.llm.kernels.rmsnorm import fused_add_rms_norm

                return fused_add_rms_norm(delta.rows, residual, self.weight, self.eps, top_k=delta.top_k)
            delta = delta.summed(residual.dtype)
        if use_fused(delta) and self.weight.dtype == delta.dtype == residual.dtype:
            from sglx.llm.kernels.rmsnorm import fused_add_rms_norm

            return fused_add_rms_norm(delta, residual, self.weight, self.eps)
        updated = residual + delta
        return self._torch(updated), updated

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
