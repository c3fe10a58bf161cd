"""DeepSeek MLA's decoupled RoPE on q_pe (every head) and the shared k_pe, in place, in one launch.

Why: the torch path (`rotate_interleaved` / `rotate_neox` in models/deepseek.py) is about seven element-wise
kernels for q and seven for k per layer; at small decode batches each costs a few microseconds even
inside a CUDA graph. The arithmetic repeats torch's: each product rounded to the dtype, then the sum
(FMA contraction off), so results equal the torch path bit for bit. Interleaved pairs (x0, x1), (x2, x3)...
come out de-interleaved ([evens', odds']) as `rotate_interleaved` writes them; q and k get the same
permutation, so every q.k product is unchanged. With `store`, the program that rotates k_pe also writes
this step's latent row [c_kv, rotated k_pe] to its slot of the MLA pool (encoded as `set_latent` does),
so the attention backend skips its own store (two index_put launches per layer). With `kv_norm` that program
also applies kv_a_layernorm to c_kv first (in place, the RMSNorm kernel's arithmetic: sglx.llm.kernels.rmsnorm),
one launch less per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import encode_for_pool, kv_format
from sglx.llm.kernels.rounding import round_to

MAX_NORM_LATENT = 4096  # kv_norm holds one latent row in a program (DeepSeek's is 512)


@triton.jit
def _mla_rope_kernel(Q, K, Cos, Sin, n_heads, stride_qt, stride_qh, stride_kt, stride_ct, stride_st,
                     C_Kv, Buf, Loc, scale, stride_ct_kv, stride_buf, Norm_W, eps,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                     STORE: tl.constexpr, NORM: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                     FMT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: q's heads, 1: the shared k_pe
    dt = Q.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    d_mask = offs < HALF
    c = tl.load(Cos + t * stride_ct + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_st + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    is_q = part == 0
    heads_total = tl.where(is_q, n_heads, 1)
    stride_h = tl.where(is_q, stride_qh, 0)
    if is_q:  # noqa: SIM108 - a Triton branch on a runtime value, not a Python ternary
        base = Q + t * stride_qt
    else:
        base = K + t * stride_kt
    for h0 in range(0, heads_total, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < heads_total)[:, None] & d_mask[None, :]
        row = base + heads[:, None] * stride_h
        if INTERLEAVED:
            x1 = tl.load(row + 2 * offs[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + 2 * offs[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(row + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = round_to(round_to(x1 * c, dt) - round_to(x2 * s, dt), dt)
        o2 = round_to(round_to(x2 * c, dt) + round_to(x1 * s, dt), dt)
        tl.debug_barrier()  # every load of the row before any store (interleaved: the output positions differ)
        tl.store(row + offs[None, :], o1.to(dt), mask=mask)
        tl.store(row + HALF + offs[None, :], o2.to(dt), mask=mask)
        if STORE:  # noqa: SIM102 - a compile-time branch around a runtime one
            if not is_q:  # this token's latent row [c_kv, k_pe] to its pool slot
                dst = Buf + tl.load(Loc + t).to(tl.int64) * stride_buf
                bt = Buf.dtype.element_ty
                rope = dst + R + heads[:, None] * 0 + offs[None, :]  # k's one row (the other rows are masked)
                tl.store(rope, encode_for_pool(o1, scale, FMT, bt), mask=mask)
                tl.store(rope + HALF, encode_for_pool(o2, scale, FMT, bt), mask=mask)
                if NORM:  # RMSNorm of the whole latent row (BLOCK_R >= R), written back, then stored
                    offs_r = tl.arange(0, BLOCK_R)
                    r_mask = offs_r < R
                    c_ptr = C_Kv + t * stride_ct_kv + offs_r
                    cdt = C_Kv.dtype.element_ty
                    xf = tl.load(c_ptr, mask=r_mask, other=0.0).to(tl.float32)
                    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, axis=0) / R + eps))
                    w = tl.load(Norm_W + offs_r, mask=r_mask, other=0.0).to(tl.float32)
                    latent = round_to(w * round_to(xf * rstd, cdt), cdt)
                    tl.store(c_ptr, latent.to(cdt), mask=r_mask)
                    tl.store(dst + offs_r, encode_for_pool(latent, scale, FMT, bt), mask=r_mask)
                else:
                    for r0 in range(0, R, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        latent = tl.load(C_Kv + t * stride_ct_kv + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
                        tl.store(dst + offs_r, encode_for_pool(latent, scale, FMT, bt), mask=offs_r < R)


def apply_mla_rotary_(q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      interleaved: bool, store: tuple | None = None,
                      kv_norm: tuple[torch.Tensor, float] | None = None) -> None:
    """Rotate q_pe [T, H, D] and k_pe [T, D] in place (views with unit stride along D) by cos/sin [T, D]
    (NeoX layout: the first half holds each frequency once).

    store = (c_kv [T, R], layer buffer [slots, 1, R + D], slots [T], scale, fp8 dtype or None): also write each
    token's [c_kv, rotated k_pe] to its slot, as MLATokenKVPool.set_latent would. kv_norm = (weight [R], eps)
    (needs store): c_kv is the raw latent; RMSNorm it in place first, as kv_a_layernorm would."""
    tokens, heads, dim = q_pe.shape
    if k_pe.shape != (tokens, dim) or cos.shape != (tokens, dim) or sin.shape != cos.shape or dim % 2:
        raise ValueError(f"MLA rotary shapes do not fit: q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}, "
                         f"cos {tuple(cos.shape)}")
    if any(t.stride(-1) != 1 for t in (q_pe, k_pe, cos, sin)):
        raise ValueError("MLA rotary rotates in place and needs unit stride along the rope dim")
    if tokens == 0:
        return
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    if kv_norm is not None and store is None:
        raise ValueError("kv_norm normalises the latent that store writes: pass store too")
    if store is None:
        c_kv, buf, loc, scale, fmt, r = k_pe, k_pe, k_pe, 1.0, 0, 0
        strides = (0, 0)
    else:
        c_kv, buf, loc, scale, fp8_dtype = store
        r = c_kv.shape[-1]
        if c_kv.shape[0] != tokens or loc.shape[0] != tokens or buf.shape[-1] != r + dim or c_kv.stride(-1) != 1:
            raise ValueError(f"latent store does not fit: c_kv {tuple(c_kv.shape)}, buffer {tuple(buf.shape)}, "
                             f"slots {tuple(loc.shape)}, rope dim {dim}")
        fmt = kv_format(fp8_dtype)
        strides = (c_kv.stride(0), buf.stride(0))
    norm_w, eps = kv_norm if kv_norm is not None else (k_pe, 0.0)
    if kv_norm is not None and (norm_w.shape != (r,) or r > MAX_NORM_LATENT):
        raise ValueError(f"kv_norm weight {tuple(norm_w.shape)} does not fit a latent of {r} (at most "
                         f"{MAX_NORM_LATENT})")
    block_r = triton.next_power_of_2(max(r, 16))  # kv_norm: the whole row; else 512-wide chunks
    if kv_norm is None:
        block_r = min(512, block_r)
    _mla_rope_kernel[(tokens, 2)](
        q_pe, k_pe, cos, sin, heads, q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), cos.stride(0), sin.stride(0),
        c_kv, buf, loc, float(scale), *strides, norm_w, float(eps),
        HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, INTERLEAVED=interleaved, STORE=store is not None,
        NORM=kv_norm is not None, R=r, BLOCK_R=block_r, FMT=fmt, num_warps=4, enable_fp_fusion=False)
