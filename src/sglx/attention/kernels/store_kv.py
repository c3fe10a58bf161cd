"""Write this step's K and V rows into their paged slots in one launch (fp8 encoding fused in).

Same contract as `TokenKVPool.set_kv`: stored = x in the pool dtype, or fp8(x / scale) as uint8 bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import encode_for_pool, kv_format, padded_dim


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


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, fp8_dtype: torch.dtype | None = None) -> None:
    """k [T, H, D], v [T, H, Dv] -> k_buffer[loc], v_buffer[loc] (uint8 fp8 bits when `fp8_dtype` is set)."""
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
