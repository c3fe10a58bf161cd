"""Triton kernels behind modulation.py (imported only when a CUDA tensor takes the fused path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ln_modulate_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, shift_ptr, out_ptr, seq, n, mod_batch_stride, eps,
                        AFFINE: tl.constexpr, MODULATE: tl.constexpr, BLOCK: tl.constexpr):
    """One token: float32 LayerNorm of its row, optional affine, then * (1 + scale) + shift; one rounding."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / n
    y = xc * tl.rsqrt(var + eps)
    if AFFINE:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) \
            + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if MODULATE:
        b = row // seq
        scale = tl.load(scale_ptr + b * mod_batch_stride + cols, mask=mask, other=0.0)
        shift = tl.load(shift_ptr + b * mod_batch_stride + cols, mask=mask, other=0.0)
        y = y * (1.0 + scale) + shift
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_residual_kernel(h_ptr, y_ptr, gate_ptr, out_ptr, seq, n, gate_batch_stride, BLOCK: tl.constexpr):
    """One token: h + y * gate in float32, rounded once to h's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + (row // seq) * gate_batch_stride + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, (h + y * gate).to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def ln_modulate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
    """x [B, S, N] contiguous; scale/shift [B, 1, N] float32 (any batch stride, unit inner stride)."""
    b, s, n = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    modulate = scale is not None
    mod_stride = scale.stride(0) if modulate else 0
    _ln_modulate_kernel[(b * s,)](x, weight if weight is not None else x, bias if bias is not None else x,
                                  scale if modulate else x, shift if modulate else x, out, s, n, mod_stride, eps,
                                  AFFINE=weight is not None, MODULATE=modulate, BLOCK=block,
                                  num_warps=_warps(block))
    return out


def gate_residual(h: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """h, y [B, S, N] contiguous; gate [B, 1, N] float32 -> h's dtype."""
    b, s, n = h.shape
    out = torch.empty_like(h)
    block = triton.next_power_of_2(n)
    _gate_residual_kernel[(b * s,)](h, y, gate, out, s, n, gate.stride(0), BLOCK=block, num_warps=_warps(block))
    return out
