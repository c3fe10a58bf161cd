"""SiLU-and-mul over the fused gate_up projection: silu(gate) * up in one kernel, torch's roundings.

torch: F.silu(gate) in the input dtype (computed in float32, rounded once), then the product with up
(rounded once). The kernel rounds at the same two places.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.rounding import round_to

BLOCK = 1024


@triton.jit
def silu_mul(g, up, DT: tl.constexpr):
    """silu(g) * up for float32 values of dtype DT, rounded where torch rounds (the activation, then the product)."""
    act = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), DT)  # torch: x / (1 + exp(-x)), IEEE division
    return round_to(act * up, DT)


@triton.jit
def _silu_and_mul_kernel(Gate_Up, Out, n_cols, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = Gate_Up.dtype.element_ty
    g = tl.load(Gate_Up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(Gate_Up + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_out + cols, silu_mul(g, up, dt).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2*I] = [gate | up] -> silu(gate) * up [..., I]."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up stacked), got {width}")
    n_cols = width // 2
    x2 = gate_up.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] and n_cols:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, BLOCK))](
            x2, out, n_cols, x2.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], n_cols)
