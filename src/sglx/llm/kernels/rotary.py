"""Rotary embedding (NeoX "rotate half") applied to q and k in place, both in one kernel.

cos/sin are the step's table [T, head_dim] (row t = token t's position, built once per step by
`RotaryEmbedding.cos_sin`), so the kernel only looks rows up. The arithmetic repeats torch's
`q * cos + rotate_half(q) * sin` in q's dtype: each product is rounded to the dtype, then the sum, so
the result equals the torch path bit for bit (FMA contraction is switched off for the same reason).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.rounding import round_to


@triton.jit
def _rotate_heads(Base, stride_h, n_heads, c, s, offs_d, d_mask, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  DT: tl.constexpr):
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        ptr = Base + heads[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = round_to(round_to(x1 * c, DT) - round_to(x2 * s, DT), DT)
        o2 = round_to(round_to(x2 * c, DT) + round_to(x1 * s, DT), DT)
        tl.store(ptr, o1.to(DT), mask=mask)
        tl.store(ptr + HALF, o2.to(DT), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Cos, Sin, n_q_heads, n_k_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, stride_st, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    c = tl.load(Cos + t * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    dt = Q.dtype.element_ty
    _rotate_heads(Q + t * stride_qt, stride_qh, n_q_heads, c, s, offs_d, d_mask, BLOCK_HQ, HALF, dt)
    _rotate_heads(K + t * stride_kt, stride_kh, n_k_heads, c, s, offs_d, d_mask, BLOCK_HK, HALF, dt)


def _heads_block(n_heads: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(n_heads), max(1, 4096 // block_d)))


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, D] (views with any row/head stride)."""
    tokens, n_q, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or cos.shape != (tokens, dim) or sin.shape != cos.shape:
        raise ValueError(f"rotary shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary rotates in place and needs unit stride along the head dim")
    if q.dtype != k.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError(f"rotary dtypes differ: q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}")
    if tokens == 0:
        return
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    n_k = k.shape[1]
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, n_q, n_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=_heads_block(n_q, block_d), BLOCK_HK=_heads_block(n_k, block_d),
        num_warps=4, enable_fp_fusion=False)
