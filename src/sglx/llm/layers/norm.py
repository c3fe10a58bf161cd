"""RMSNorm, computed in float32 and cast back exactly where Hugging Face does, so logits match bit-closely.

On CUDA tensors (when triton imports) one fused Triton kernel does the whole norm, and `add_and_norm`
also folds in the residual add that precedes every norm of a decoder layer; CPU runs the torch code.
"""

from __future__ import annotations

import torch
from torch import nn

from sglx.llm.kernels import env_switch, use_fused
from sglx.llm.layers.linear import gemv_eligible, linear

# Rows up to this wide take the norm inside the GEMV. Measured in graphs on the H200 (bench_gemv.py, session 23):
# DeepSeek-V2-Lite's q + kv_a (2,048 inputs) 7.80 us against 8.79 for the norm kernel then the GEMV; Llama-3.1-8B's
# qkv and gate_up (4,096) 22.96 / 68.45 us against 18.62 / 63.91, so there the norm stays a kernel of its own.
NORM_INSIDE_MAX_INPUTS = 2048
# SGLX_GEMV_EPILOGUES=0: wider one-row products keep plain GEMVs, then the rotary and SiLU-and-mul kernels
_EPILOGUES_ON = env_switch("SGLX_GEMV_EPILOGUES")


def epilogue_width_applies(width: int) -> bool:
    """The epilogue GEMVs' rule on a row's width: switched on, wider than NORM_INSIDE_MAX_INPUTS (narrower rows
    take the norm inside the GEMV instead). Shared by `epilogue_gemv_applies` and norm folding at load."""
    return _EPILOGUES_ON and width > NORM_INSIDE_MAX_INPUTS


def epilogue_gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the one-row product of a normed row takes a GEMV with an epilogue (qkv + rotary + K/V store, gate_up
    + SiLU-and-mul: sglx.llm.kernels.gemv_rotary / gemv_gated) after the norm kernel: rows wider than
    NORM_INSIDE_MAX_INPUTS (narrower ones take the norm inside the GEMV instead), fit for the GEMV. Measured on the
    H200 (session 24): qkv 15.98 us against 18.09 for the GEMV then the rotary kernel, gate_up 61.05 against 62.68."""
    return epilogue_width_applies(x.shape[-1]) and gemv_eligible(x, weight, bias)


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

    def add_and_norm(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta): the residual stream update and the next norm at once."""
        if use_fused(delta) and self.weight.dtype == delta.dtype == residual.dtype:
            from sglx.llm.kernels.rmsnorm import fused_add_rms_norm

            return fused_add_rms_norm(delta, residual, self.weight, self.eps)
        updated = residual + delta
        return self._torch(updated), updated

    def add_to_stream(self, delta: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta), or for the first layer's input (no residual yet)
        (norm(delta), delta)."""
        if residual is None:
            return self(delta), delta
        return self.add_and_norm(delta, residual)

    def norm_linear(self, delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(residual + delta)), residual + delta), or with no residual (the first layer's input)
        (linear(norm(delta)), delta). One GEMV kernel for a one-row CUDA step of at most NORM_INSIDE_MAX_INPUTS
        features (the norm inside it, without the normed row's two roundings to the input dtype); otherwise the
        norm, then `linear`."""
        same = self.weight.dtype == delta.dtype and (residual is None or residual.dtype == delta.dtype)
        if same and weight.shape[1] <= NORM_INSIDE_MAX_INPUTS and gemv_eligible(delta, weight, bias):
            from sglx.llm.kernels.gemv import NormInput, gemv

            y, updated = gemv(delta, weight, bias, NormInput(self.weight, self.eps, residual))
            return y, (delta if updated is None else updated)
        h, updated = self.add_to_stream(delta, residual)
        return linear(h, weight, bias), updated

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
