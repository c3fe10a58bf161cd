"""Write this step's K and V rows into their paged slots in one launch (fp8 encoding fused in).

Same contract as `TokenKVPool.set_kv`: stored = x in the pool dtype, or fp8(x / scale) as uint8 bits, with
one static scale per layer (`store_kv`) or, for a pool with per-token scales, keys rotated by the pool's
`k_rotation` and each (token, head) row given its own scale, written next to the bits (`store_kv_to_pool`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import encode_for_pool, kv_format, padded_dim, quantize_rows


@triton.jit
def _store_kv_kernel(
    K, V, K_Buf, V_Buf, Loc, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bkt, stride_bkh, stride_bvt, stride_bvh,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FMT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    v_mask = (offs_h[:, None] < H) & (offs_dv[None, :] < DV)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=k_mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=v_mask)
    k = encode_for_pool(k.to(tl.float32), k_scale, FMT, K_Buf.dtype.element_ty)
    v = encode_for_pool(v.to(tl.float32), v_scale, FMT, V_Buf.dtype.element_ty)
    tl.store(K_Buf + slot * stride_bkt + offs_h[:, None] * stride_bkh + offs_d[None, :], k, mask=k_mask)
    tl.store(V_Buf + slot * stride_bvt + offs_h[:, None] * stride_bvh + offs_dv[None, :], v, mask=v_mask)


@triton.jit
def _store_kv_per_token_kernel(
    K, V, K_Buf, V_Buf, K_Scale, V_Scale, Loc, Mult,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_bkt, stride_bkh, stride_bvt, stride_bvh, stride_ks, stride_vs,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FMT: tl.constexpr,
    STEPS: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_mask = offs_h < H
    k_mask = h_mask[:, None] & (offs_d[None, :] < D)
    v_mask = h_mask[:, None] & (offs_dv[None, :] < DV)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=k_mask, other=0.0)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=v_mask, other=0.0)
    k_bits, k_scale = quantize_rows(k.to(tl.float32), Mult, FMT, STEPS, MIN_SCALE)
    v_bits, v_scale = quantize_rows(v.to(tl.float32), Mult, FMT, 1, MIN_SCALE)
    tl.store(K_Buf + slot * stride_bkt + offs_h[:, None] * stride_bkh + offs_d[None, :], k_bits, mask=k_mask)
    tl.store(V_Buf + slot * stride_bvt + offs_h[:, None] * stride_bvh + offs_dv[None, :], v_bits, mask=v_mask)
    tl.store(K_Scale + slot * stride_ks + offs_h, k_scale, mask=h_mask)
    tl.store(V_Scale + slot * stride_vs + offs_h, v_scale, mask=h_mask)


def store_kv_to_pool(pool, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor) -> None:  # noqa: ANN001
    """k [T, H, D], v [T, H, Dv] -> the pool's layer at `loc`, in whatever scale mode the pool uses."""
    if getattr(pool, "k_rotation", None) is not None:
        # keys into the pool's rotated basis by one float32 GEMM, the same call the pool's own set_kv makes (per-token
        # pools always rotate; static ones after calibrate_static_scales). A [D, D] rotation inside the per-token
        # kernel (one token per program) spilled registers on the H100: 1.28 ms for 4096 tokens.
        k = k.float() @ pool.k_rotation
    if not pool.per_token_scales:
        fp8_dtype = pool.layer_fp8_dtype(layer_id) if hasattr(pool, "layer_fp8_dtype") else pool.fp8_dtype
        store_kv(k, v, pool.k_buffer[layer_id], pool.v_buffer[layer_id], loc, pool.k_scale[layer_id],
                 pool.v_scale[layer_id], fp8_dtype)  # None for a layer kept in the model dtype
        return
    from sglx.llm.kv_cache import MIN_SCALE

    num_tokens, heads, dim = k.shape
    if num_tokens == 0:
        return
    if v.stride(-1) != 1:  # k is the rotation's fresh, contiguous output
        v = v.contiguous()
    k_buffer, v_buffer = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
    k_scale, v_scale = pool.k_scale[layer_id], pool.v_scale[layer_id]
    mult = pool.scale_multipliers
    _store_kv_per_token_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, k_scale, v_scale, loc, mult,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_scale.stride(0), v_scale.stride(0),
        H=heads, D=dim, DV=v.shape[-1], BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=padded_dim(dim),
        BLOCK_DV=padded_dim(v.shape[-1]), FMT=kv_format(pool.fp8_dtype), STEPS=mult.numel(), MIN_SCALE=MIN_SCALE,
        num_warps=4,
    )


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, fp8_dtype: torch.dtype | None = None) -> None:
    """k [T, H, D], v [T, H, Dv] -> k_buffer[loc], v_buffer[loc] (uint8 fp8 bits when `fp8_dtype` is set).

    One static scale for K and one for V; a pool with per-token scales is written by `store_kv_to_pool`.
    """
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        raise TypeError("store_kv takes one float scale for K and V; this pool keeps per-token scales "
                        "(pool.per_token_scales): write it with store_kv_to_pool(pool, layer, k, v, loc)")
    num_tokens, heads, dim = k.shape
    dim_v = v.shape[-1]
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, loc, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        H=heads, D=dim, DV=dim_v, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=padded_dim(dim),
        BLOCK_DV=padded_dim(dim_v), FMT=kv_format(fp8_dtype), num_warps=4,
    )
