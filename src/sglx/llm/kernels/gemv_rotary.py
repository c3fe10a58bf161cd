"""One row's q/k/v product with rotary on q and k and this step's K/V stored to the pool, in one kernel.

Why: at batch 1 the rotary + K/V store kernel after the qkv GEMV is a launch of its own (32 a step, about 78 us of
Llama-3.1-8B's 4.4 ms on the H200, session 23 profile). The NeoX rotation mixes feature i of a head with feature
i + D/2, so each program here owns whole pairs (rows i and i + D/2 of q or k heads, gathered into one tile) and
rotates them as an epilogue; the programs past the q/k pairs own V rows and only store them. Roundings are the unfused
path's: the products rounded to the dtype (the qkv output), then the rotary kernel's arithmetic (sglx.llm.kernels
.rotary) and the pool's encoding (its dtype or fp8 bits of x / scale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import encode_for_pool, kv_format
from sglx.llm.kernels.gemv import GemvConfig, halves, launch_params, one_row, rms_args, row_products
from sglx.llm.kernels.pdl import pdl_args, pdl_prologue
from sglx.llm.kernels.rotary import rotate_pair
from sglx.llm.kernels.rounding import round_to

if TYPE_CHECKING:
    from sglx.attention.llm.kv_store import StepKVSlots


# The folded norm's sum of squares in a pass over x before the loop: 16.62 us against 19.34 in the loop and 18.63 for
# the norm kernel then this GEMV (H200, Llama-3.1-8B qkv in graphs, session 25): in the loop it needs 88 registers,
# which split the 768-program grid into two waves (72 registers, or 79 with the pass: one wave).
RMS_PASS = 2


@triton.jit
def _gemv_rotary_kernel(X, W, B, Cos, Sin, Q, K_Buf, V_Buf, Loc, k_scale, v_scale, K, stride_wn,
                        stride_kt, stride_kh, stride_vt, stride_vh, n_q_heads, n_kv_heads, rotary_programs, eps,
                        D: tl.constexpr, HAS_BIAS: tl.constexpr, FMT: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_K: tl.constexpr, RMS: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    dt = Q.dtype.element_ty
    half: tl.constexpr = D // 2
    if pid < rotary_programs:  # BLOCK_P rotary pairs (row i and row i + D/2 of one q or k head) in one tile
        lane = tl.arange(0, 2 * BLOCK_P)
        pair = pid * BLOCK_P + lane % BLOCK_P
        row = (pair // half) * D + pair % half + (lane // BLOCK_P) * half
        y = row_products(X, W + row[:, None].to(tl.int64) * stride_wn, pair < (n_q_heads + n_kv_heads) * half,
                         K, eps, BLOCK_K, RMS, KP)
        if HAS_BIAS:
            y += tl.load(B + row, mask=pair < (n_q_heads + n_kv_heads) * half, other=0.0).to(tl.float32)
        x1, x2 = halves(round_to(y, dt), BLOCK_P)
        pair = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        mask = pair < (n_q_heads + n_kv_heads) * half
        head = pair // half
        i = pair % half
        c = tl.load(Cos + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(Sin + i, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rotate_pair(x1, x2, c, s, dt)
        is_q = head < n_q_heads
        slot = tl.load(Loc).to(tl.int64)  # after the loop: live across it, it cost registers (and occupancy)
        q_dst = Q + head * D + i
        tl.store(q_dst, o1.to(dt), mask=mask & is_q)
        tl.store(q_dst + half, o2.to(dt), mask=mask & is_q)
        k_dst = K_Buf + slot * stride_kt + (head - n_q_heads) * stride_kh + i
        is_k = mask & (head >= n_q_heads)
        tl.store(k_dst, encode_for_pool(o1, k_scale, FMT, K_Buf.dtype.element_ty), mask=is_k)
        tl.store(k_dst + half, encode_for_pool(o2, k_scale, FMT, K_Buf.dtype.element_ty), mask=is_k)
    else:  # 2 * BLOCK_P V features, stored only
        v = (pid - rotary_programs) * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P)
        v_mask = v < n_kv_heads * D  # names apart from the other branch's: Triton joins same-named values
        v_row = (n_q_heads + n_kv_heads) * D + v
        v_y = row_products(X, W + v_row[:, None].to(tl.int64) * stride_wn, v_mask, K, eps, BLOCK_K, RMS, KP)
        if HAS_BIAS:
            v_y += tl.load(B + v_row, mask=v_mask, other=0.0).to(tl.float32)
        v_slot = tl.load(Loc).to(tl.int64)
        tl.store(V_Buf + v_slot * stride_vt + (v // D) * stride_vh + v % D,
                 encode_for_pool(round_to(v_y, dt), v_scale, FMT, V_Buf.dtype.element_ty), mask=v_mask)


def gemv_rotary_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, slots: StepKVSlots,
                      config: GemvConfig = GemvConfig(), interpret: bool = False, rms_eps: float | None = None
                      ) -> torch.Tensor:
    """q [num_q_heads, D] rotated, for one row x and weight = [W_q; W_k; W_v] ([(Hq + 2 Hkv) D, K], rows
    contiguous); the rotated k and v go to `slots` (one slot). cos/sin: the token's row of the step's table [D]
    (any leading shape of one row). What `linear`, the rotary kernel and the K/V store give, in one launch.
    rms_eps: x is the unnormed residual stream and weight holds the norm's scale (`row_products`' RMS)."""
    k = x.shape[-1]
    rows = weight.shape[0]
    heads = num_q_heads + 2 * num_kv_heads
    d = rows // heads if heads else 0
    if weight.shape[1] != k or weight.stride(-1) != 1 or d * heads != rows or d % 2:
        raise ValueError(f"gemv_rotary_store needs a [({num_q_heads} + 2 x {num_kv_heads}) x D, {k}] weight with "
                         f"contiguous rows and an even D, got {tuple(weight.shape)}")
    if slots.loc.numel() != 1:
        raise ValueError(f"gemv_rotary_store stores one token, got {slots.loc.numel()} slots")
    kb, vb = slots.k_buffer, slots.v_buffer
    if kb.shape[-1] != d or vb.shape[-1] != d or kb.stride(-1) != 1 or vb.stride(-1) != 1:
        raise ValueError(f"KV buffers {tuple(kb.shape)} / {tuple(vb.shape)} do not hold heads of {d}")
    q = torch.empty(num_q_heads, d, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch_params(rows, k, config, interpret)
    block_p = max(1, block_n // 2)
    rotary_programs = triton.cdiv((num_q_heads + num_kv_heads) * (d // 2), block_p)
    v_programs = triton.cdiv(num_kv_heads * d, 2 * block_p)
    _gemv_rotary_kernel[(rotary_programs + v_programs,)](
        one_row(x, k, "x"), weight, bias if bias is not None else weight, one_row(cos, d, "cos"),
        one_row(sin, d, "sin"), q, kb, vb, slots.loc, slots.k_scale, slots.v_scale, k, weight.stride(0),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), num_q_heads, num_kv_heads, rotary_programs,
        D=d, HAS_BIAS=bias is not None, FMT=kv_format(slots.fp8_dtype), BLOCK_P=block_p, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **rms_args(k, rms_eps, config, RMS_PASS),
        **pdl_args(weight, interpret, config.pdl))
    return q
