"""Rotary embedding (NeoX "rotate half") applied to q and k in place, both in one kernel.

cos/sin are the step's table [T, head_dim] (row t = token t's position, built once per step by
`RotaryEmbedding.cos_sin`), so the kernel only looks rows up. The arithmetic repeats torch's
`q * cos + rotate_half(q) * sin` in q's dtype: each product is rounded to the dtype, then the sum, so
the result equals the torch path bit for bit (FMA contraction is switched off for the same reason).
`apply_rotary_and_store_` also writes the rotated K and the V of each token to its KV-pool slot, so
an attention backend that uses it (triton) saves the separate K/V store launch of every layer.
`rms_of` (batched decode with the norm scales folded into qkv, sglx.llm.layers.norm_folding): q, k and v are the
product of the unnormed residual stream h, so each token's q, k and v are first scaled by its 1 / rms(h) and rounded
(the values the product of the normed row would have), which saves the add + norm kernel before the qkv product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import encode_for_pool, kv_format, padded_dim
from sglx.llm.kernels.activation import row_rstd
from sglx.llm.kernels.rounding import round_to


@triton.jit
def rotate_pair(x1, x2, c, s, DT: tl.constexpr):
    """NeoX rotation of the pair (x1, x2) = (x[i], x[i + D/2]) by cos/sin c, s, in torch's roundings to DT: each
    product, then the sum (float32 values of dtype DT)."""
    o1 = round_to(round_to(x1 * c, DT) - round_to(x2 * s, DT), DT)
    o2 = round_to(round_to(x2 * c, DT) + round_to(x1 * s, DT), DT)
    return o1, o2


@triton.jit
def _rotate_heads(Base, stride_h, n_heads, c, s, offs_d, d_mask, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  DT: tl.constexpr, Buf, stride_bh, scale, STORE: tl.constexpr, FMT: tl.constexpr, H_row, n_hidden,
                  eps, SCALED: tl.constexpr, BLOCK_HID: tl.constexpr, Bias, HAS_BIAS: tl.constexpr):
    """Rotate n_heads rows of one token in place (SCALED: each value times 1 / rms of the row at H_row, rounded,
    first, then HAS_BIAS: plus its bias at Bias [heads, D], rounded); STORE also writes them (fp8-encoded when FMT)
    to Buf."""
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        ptr = Base + heads[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            rstd = row_rstd(H_row, n_hidden, eps, BLOCK_HID)
            x1 = round_to(x1 * rstd, DT)
            x2 = round_to(x2 * rstd, DT)
            if HAS_BIAS:
                b_ptr = Bias + heads[:, None] * (2 * HALF) + offs_d[None, :]
                x1 = round_to(x1 + tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32), DT)
                x2 = round_to(x2 + tl.load(b_ptr + HALF, mask=mask, other=0.0).to(tl.float32), DT)
        o1, o2 = rotate_pair(x1, x2, c, s, DT)
        tl.store(ptr, o1.to(DT), mask=mask)
        tl.store(ptr + HALF, o2.to(DT), mask=mask)
        if STORE:
            dst = Buf + heads[:, None] * stride_bh + offs_d[None, :]
            tl.store(dst, encode_for_pool(o1, scale, FMT, Buf.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, encode_for_pool(o2, scale, FMT, Buf.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Cos, Sin, n_q_heads, n_k_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, stride_st, V, K_Buf, V_Buf, Loc, k_scale, v_scale, stride_vt, stride_vh,
                   stride_bkt, stride_bkh, stride_bvt, stride_bvh, H, stride_ht, n_hidden, eps, Bias,
                   HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   STORE: tl.constexpr, FMT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                   SCALED: tl.constexpr, BLOCK_HID: tl.constexpr, HAS_BIAS: tl.constexpr):
    # one program per (token, part): q, k (+ its store) and V (its store, its row scale) run side by side, so a
    # decode step of one request is not a single program walking all three in turn
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    dt = Q.dtype.element_ty
    H_row = H + t * stride_ht
    if part == 2:  # STORE or SCALED only: this token's V to its slot, scaled in place
        slot = 0
        if STORE:
            slot = tl.load(Loc + t).to(tl.int64)
        offs_dv = tl.arange(0, BLOCK_DV)
        for h0 in range(0, n_k_heads, BLOCK_HK):
            heads = h0 + tl.arange(0, BLOCK_HK)
            mask = (heads < n_k_heads)[:, None] & (offs_dv < DV)[None, :]
            v_ptr = V + t * stride_vt + heads[:, None] * stride_vh + offs_dv[None, :]
            v = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
            if SCALED:
                v = round_to(v * row_rstd(H_row, n_hidden, eps, BLOCK_HID), dt)
                if HAS_BIAS:  # v's bias follows q's and k's in the fused qkv bias
                    v_bias = Bias + (n_q_heads + n_k_heads) * (2 * HALF) + heads[:, None] * DV + offs_dv[None, :]
                    v = round_to(v + tl.load(v_bias, mask=mask, other=0.0).to(tl.float32), dt)
                tl.store(v_ptr, v.to(dt), mask=mask)
            if STORE:
                tl.store(V_Buf + slot * stride_bvt + heads[:, None] * stride_bvh + offs_dv[None, :],
                         encode_for_pool(v, v_scale, FMT, V_Buf.dtype.element_ty), mask=mask)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        c = tl.load(Cos + t * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(Sin + t * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        if part == 0:
            _rotate_heads(Q + t * stride_qt, stride_qh, n_q_heads, c, s, offs_d, d_mask, BLOCK_HQ, HALF, dt,
                          K_Buf, 0, 1.0, False, 0, H_row, n_hidden, eps, SCALED, BLOCK_HID, Bias, HAS_BIAS)
        elif STORE:  # this token's K goes to its KV slot on the way
            slot = tl.load(Loc + t).to(tl.int64)
            _rotate_heads(K + t * stride_kt, stride_kh, n_k_heads, c, s, offs_d, d_mask, BLOCK_HK, HALF, dt,
                          K_Buf + slot * stride_bkt, stride_bkh, k_scale, True, FMT, H_row, n_hidden, eps, SCALED,
                          BLOCK_HID, Bias + n_q_heads * (2 * HALF), HAS_BIAS)
        else:
            _rotate_heads(K + t * stride_kt, stride_kh, n_k_heads, c, s, offs_d, d_mask, BLOCK_HK, HALF, dt,
                          K, 0, 1.0, False, 0, H_row, n_hidden, eps, SCALED, BLOCK_HID, Bias + n_q_heads * (2 * HALF),
                          HAS_BIAS)


def _heads_block(n_heads: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(n_heads), max(1, 4096 // block_d)))


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens, _, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or cos.shape != (tokens, dim) or sin.shape != cos.shape:
        raise ValueError(f"rotary shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary rotates in place and needs unit stride along the head dim")
    if q.dtype != k.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError(f"rotary dtypes differ: q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}")


@dataclass(frozen=True)
class RowScale:
    """Scale each token's q, k and v by 1 / sqrt(mean(h^2) + eps) of its row of `h` [T, hidden] before rotating (the
    norm of the qkv product's input, applied after the product), then add `bias` (the fused qkv bias [Hq*D + 2*Hkv*D],
    which the product left out): v [T, Hkv, Dv] is scaled in place too."""

    h: torch.Tensor
    v: torch.Tensor
    eps: float
    bias: torch.Tensor | None = None


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  row_scale: RowScale | None = None) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, D] (views with any row/head stride)."""
    _launch(q, k, cos, sin, None, row_scale)


def apply_rotary_and_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                            k_scale: float = 1.0, v_scale: float = 1.0, fp8_dtype: torch.dtype | None = None,
                            rms_of: torch.Tensor | None = None, eps: float = 0.0, bias: torch.Tensor | None = None
                            ) -> None:
    """apply_rotary_, and this step's rotated K and its V written to their KV slots `loc` in the same kernel.

    Stores exactly what `store_kv` would (the pool dtype, or uint8 bits of fp8(x / scale)), one launch
    fewer per layer. rms_of: q, k and v (in place) scaled by each token's 1 / rms of its row of rms_of first, then
    `bias` added (`RowScale`).
    """
    if v.shape[:2] != k.shape[:2] or loc.shape[0] != k.shape[0]:
        raise ValueError(f"v {tuple(v.shape)} / loc {tuple(loc.shape)} do not fit k {tuple(k.shape)}")
    if v.stride(-1) != 1:
        if rms_of is not None:
            raise ValueError("a row-scaled rotary scales v in place and needs unit stride along its head dim")
        v = v.contiguous()
    row_scale = None if rms_of is None else RowScale(rms_of, v, eps, bias)
    _launch(q, k, cos, sin, (v, k_buffer, v_buffer, loc, float(k_scale), float(v_scale), fp8_dtype), row_scale)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store: tuple | None,
            row_scale: RowScale | None = None) -> None:
    _check(q, k, cos, sin)
    tokens, n_q, dim = q.shape
    if tokens == 0:
        return
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    n_k = k.shape[1]
    if store is None:
        v, k_buf, v_buf, loc, k_scale, v_scale, fmt = k, k, k, k, 1.0, 1.0, 0
        if row_scale is not None:
            v = row_scale.v
        strides = (v.stride(0), v.stride(1), 0, 0, 0, 0)
    else:
        v, k_buf, v_buf, loc, k_scale, v_scale, fp8_dtype = store
        fmt = kv_format(fp8_dtype)
        strides = (v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1))
    h, eps, bias = q, 0.0, None
    if row_scale is not None:
        h, eps, bias = row_scale.h, float(row_scale.eps), row_scale.bias
        if (h.dim() != 2 or h.shape[0] != tokens or h.dtype != q.dtype or h.stride(-1) != 1
                or row_scale.v.shape[:2] != k.shape[:2] or row_scale.v.stride(-1) != 1):
            raise ValueError(f"row scale: h {tuple(h.shape)} {h.dtype} must be [tokens, hidden] rows of q's dtype "
                             f"and v {tuple(row_scale.v.shape)} [tokens, kv heads, D], both of unit stride")
        width = (n_q + n_k) * dim + n_k * row_scale.v.shape[-1]
        if bias is not None and (bias.shape != (width,) or bias.dtype != q.dtype or bias.stride(-1) != 1):
            raise ValueError(f"row scale: the qkv bias {tuple(bias.shape)} {bias.dtype} must be [{width}] of q's "
                             "dtype")
    dim_v = v.shape[-1]
    _rotary_kernel[(tokens, 3 if store is not None or row_scale is not None else 2)](
        q, k, cos, sin, n_q, n_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        v, k_buf, v_buf, loc, k_scale, v_scale, *strides, h, h.stride(0), h.shape[-1], eps,
        bias if bias is not None else q,
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=_heads_block(n_q, block_d), BLOCK_HK=_heads_block(n_k, block_d),
        STORE=store is not None, FMT=fmt, DV=dim_v, BLOCK_DV=padded_dim(dim_v),
        SCALED=row_scale is not None, BLOCK_HID=triton.next_power_of_2(h.shape[-1]) if row_scale else 16,
        HAS_BIAS=bias is not None,
        num_warps=4, enable_fp_fusion=False)
