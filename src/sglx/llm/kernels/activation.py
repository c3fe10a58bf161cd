"""SiLU-and-mul over the fused gate_up projection: silu(gate) * up in one kernel, torch's roundings.

torch: F.silu(gate) in the input dtype (computed in float32, rounded once), then the product with up
(rounded once). The kernel rounds at the same two places.

`rms_of` (batched decode with the norm scales folded into gate_up, sglx.llm.layers.norm_folding): gate_up is the
product of the unnormed residual stream h, so each row's gate and up are first scaled by that row's 1 / rms(h) and
rounded (the value the product of the normed row would have), which saves the add + norm kernel before gate_up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.rounding import round_to

BLOCK = 1024
# row-scaled launches (each program also reads its row of h): columns a program, warps
SCALED_BLOCK, SCALED_WARPS = 1024, 4


@triton.jit
def silu_mul(g, up, DT: tl.constexpr):
    """silu(g) * up for float32 values of dtype DT, rounded where torch rounds (the activation, then the product)."""
    act = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), DT)  # torch: x / (1 + exp(-x)), IEEE division
    return round_to(act * up, DT)


@triton.jit
def row_rstd(H_row, n_hidden, eps, BLOCK_H: tl.constexpr):
    """1 / rms of the row at H_row (float32 sum of squares over n_hidden values, as the RMSNorm kernel). Callers
    issue their own loads first, so this row's load is in flight with them rather than in front of them."""
    offs = tl.arange(0, BLOCK_H)
    h = tl.load(H_row + offs, mask=offs < n_hidden, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, axis=0) / n_hidden + eps)


@triton.jit
def _silu_and_mul_kernel(Gate_Up, Out, n_cols, stride_in, stride_out, H, stride_h, n_hidden, eps,
                         BLOCK: tl.constexpr, SCALED: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = Gate_Up.dtype.element_ty
    g = tl.load(Gate_Up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(Gate_Up + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        rstd = row_rstd(H + row * stride_h, n_hidden, eps, BLOCK_H)
        g = round_to(g * rstd, dt)
        up = round_to(up * rstd, dt)
    tl.store(Out + row * stride_out + cols, silu_mul(g, up, dt).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, rms_of: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """gate_up [..., 2*I] = [gate | up] -> silu(gate) * up [..., I]; with rms_of (rows [T, hidden] of gate_up's
    dtype, one a row of gate_up), gate and up scaled by each row's 1 / sqrt(mean(h^2) + eps) first."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up stacked), got {width}")
    n_cols = width // 2
    x2 = gate_up.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    h, block, warps = x2, BLOCK, 4
    if rms_of is not None:
        h = rms_of.reshape(-1, rms_of.shape[-1])
        if h.shape[0] != x2.shape[0] or h.dtype != x2.dtype or h.stride(-1) != 1:
            raise ValueError(f"rms_of {tuple(rms_of.shape)} {rms_of.dtype} must hold one unit-stride {gate_up.dtype} "
                             f"row for each row of gate_up {tuple(gate_up.shape)}")
        block, warps = min(SCALED_BLOCK, triton.next_power_of_2(n_cols)), SCALED_WARPS
    if x2.shape[0] and n_cols:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
            x2, out, n_cols, x2.stride(0), out.stride(0), h, h.stride(0), h.shape[-1], float(eps),
            BLOCK=block, SCALED=rms_of is not None,
            BLOCK_H=triton.next_power_of_2(h.shape[-1]) if rms_of is not None else 16, num_warps=warps)
    return out.view(*gate_up.shape[:-1], n_cols)
