"""The Triton kernel behind qk_norm_rope.norm_rope (imported only when a CUDA tensor takes the fused path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, seq, x_row_stride, x_batch_stride, eps,
                      HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr):
    """One token: RMSNorm over its HEADS*DIM values, times the weight, then rotary per head."""
    row = tl.program_id(0)
    b = row // seq
    s = row % seq
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, DIM)[None, :]
    mask = (heads < HEADS) & (cols < DIM)
    offs = heads * DIM + cols
    x = tl.load(x_ptr + b * x_batch_stride + s * x_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(tl.sum(x * x, axis=1), axis=0) / (HEADS * DIM)
    n = (x * tl.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty)  # torch rounds the normalised value
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    n = (n.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        c = tl.load(cos_ptr + s * DIM + cols)
        sn = tl.load(sin_ptr + s * DIM + cols)
        n0, n1 = tl.split(tl.reshape(n, (HEADS_PAD, DIM // 2, 2)))
        c0, _c1 = tl.split(tl.reshape(tl.broadcast_to(c, (HEADS_PAD, DIM)), (HEADS_PAD, DIM // 2, 2)))
        _s0, s1 = tl.split(tl.reshape(tl.broadcast_to(sn, (HEADS_PAD, DIM)), (HEADS_PAD, DIM // 2, 2)))
        y0 = n0 * c0 - n1 * s1
        y1 = n0 * s1 + n1 * c0
        n = tl.reshape(tl.join(y0, y1), (HEADS_PAD, DIM))
    tl.store(out_ptr + row * HEADS * DIM + offs, n.to(out_ptr.dtype.element_ty), mask=mask)


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int,
           rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x [B, S, H*D] with unit inner stride -> contiguous [B, S, H, D] in x's dtype."""
    b, s, n = x.shape
    dim = n // heads
    out = torch.empty(b, s, heads, dim, device=x.device, dtype=x.dtype)
    cos, sin = rotary if rotary is not None else (x, x)  # unused without rotary
    if rotary is not None:
        cos, sin = cos.reshape(s, dim).contiguous(), sin.reshape(s, dim).contiguous()
    _norm_rope_kernel[(b * s,)](x, weight, cos, sin, out, s, x.stride(1), x.stride(0), eps, HEADS=heads,
                                HEADS_PAD=triton.next_power_of_2(heads), DIM=dim, ROPE=rotary is not None,
                                num_warps=4)
    return out
