"""MLA decode stage 1 for Hopper in Gluon (Triton's explicit-layout dialect): the latent tiles double-buffered by hand.

Why not `tl.dot` alone (mla_decode.py): the 64-head launch fills shared memory with the query (72 KB) and two
latent stages (2 x 72 KB), and Triton's pipeliner issues the copy of tile i + 1 at the end of iteration i, so
every iteration waits out most of a tile's load (the TTGIR shows it, session 18). Here the copy of tile i + 1
is issued at the top of iteration i, as soon as its buffer is free (iteration i - 1's PV product is waited for
inside i - 1), so it overlaps all of tile i's work. Slot ids are read a tile ahead, so no global load sits in
front of a copy's addresses; the softmax denominator is summed over keys once, after the loop, instead of
across the two warpgroups every tile. The PV product is waited for where it is issued: left in flight across
the loop's back edge, ptxas serialises every wgmma of the loop (C7515) and the kernel was 13% slower (H200,
session 18: 0.221 against 0.195 ms, B64 H128 ctx 4096). fp8 latents (FMT 1-3) land as bytes in two 36 KB stages
and are converted into one 16-bit tile before the products (0.440 -> 0.339 ms against the `tl.dot` kernel; e4m3 under
bf16 queries by integer bit moves instead of the conversion unit, FMT 3: 0.339 -> 0.297 ms, session 22). Same
contract as `_mla_decode_stage1`: 64 heads a program, 64-key tiles, 8 warps, latents of 512 + 64, writing the output
itself with one split or float32 partials + log2-sum-exp for the merge.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sglx.attention.kernels.common import BITS_K_Q_LIFT, E4M3_TO_BF16_SCALED_PTX
from sglx.attention.kernels.mla_decode import _program_keys

# builtins renamed after Triton 3.6 (the lent GPU's): the CTA-wide barrier and the cp.async copy
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _issue_tile(lat_buf, pe_buf, Kv_Buf, slots, rows_valid, stride_kt,
                R: gl.constexpr, DR: gl.constexpr, lat_layout: gl.constexpr, pe_layout: gl.constexpr):
    """cp.async of one tile's latent [N, R] and rope [N, DR] rows (slots in lat_layout's row slice) into smem."""
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, lat_layout))
    base = slots.to(gl.int64) * stride_kt
    ptrs = Kv_Buf + base[:, None] + cols[None, :]
    _cp_async(lat_buf, ptrs, mask=rows_valid[:, None] & (cols[None, :] < R))
    pe_base = gl.convert_layout(base, gl.SliceLayout(1, pe_layout))
    pe_valid = gl.convert_layout(rows_valid, gl.SliceLayout(1, pe_layout))
    pe_cols = gl.arange(0, DR, layout=gl.SliceLayout(0, pe_layout))
    pe_ptrs = Kv_Buf + pe_base[:, None] + R + pe_cols[None, :]
    _cp_async(pe_buf, pe_ptrs, mask=pe_valid[:, None] & (pe_cols[None, :] < DR))
    async_copy.commit_group()


@gluon.jit
def _tile_operands(lat_buf, pe_buf, lat_cvt, pe_cvt, dtype: gl.constexpr, FMT: gl.constexpr, R: gl.constexpr):
    """The tile's latent and rope rows as wgmma operands: the landed buffers themselves, or (fp8 bits, FMT 1-3)
    their values in `dtype`, written 128 columns at a time into the one 16-bit tile (the caller fences and syncs)."""
    if FMT == 0:
        lat, pe = lat_buf, pe_buf
    else:
        cvt_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])
        for c in gl.static_range(R // 128):
            bits = lat_buf.slice(c * 128, 128, dim=1).load(cvt_layout)
            lat_cvt.slice(c * 128, 128, dim=1).store(_fp8_bits_to(bits, dtype, FMT))
        bits = pe_buf.load(gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0]))  # exactly [64, 64], no copies
        pe_cvt.store(_fp8_bits_to(bits, dtype, FMT))
        lat, pe = lat_cvt, pe_cvt
    return lat, pe


@gluon.jit
def _fp8_bits_to(bits, dtype: gl.constexpr, FMT: gl.constexpr):
    """fp8 bits in `dtype`: FMT 1 / 2 cast from e4m3 / e5m2 (F2FP to float16, then F2F to bfloat16: the SM's
    quarter-rate conversion unit, per value); FMT 3 (e4m3 into bfloat16) by integer bit moves at 2**-120 of the
    value (common.e4m3_bits_to_bf16_scaled: exact, subnormals included), the caller taking the scale back."""
    if FMT == 3:
        vals = gl.inline_asm_elementwise(E4M3_TO_BF16_SCALED_PTX, "=r,=r,r", [bits], dtype=gl.bfloat16, is_pure=True,
                                         pack=4)
    else:
        fp8: gl.constexpr = gl.float8e4nv if FMT == 1 else gl.float8e5
        vals = bits.to(fp8, bitcast=True).to(dtype)
    return vals


@gluon.jit
def _store_result(acc, l_i, m_i, v_scale, Out, Mid_O, Mid_Lse, b, split, head_block,
                  stride_out_b, stride_out_h, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  H: gl.constexpr, R: gl.constexpr, COL0: gl.constexpr, SINGLE: gl.constexpr, LSE: gl.constexpr):
    """acc / l * v_scale for latent columns [COL0, COL0 + acc's width): the answer with one split, else the float32
    partial and (LSE) each head's log2-sum-exp m + log2(l), in l's layout. Shared by both Gluon stage-1 kernels."""
    o_layout: gl.constexpr = acc.type.layout
    BLOCK_H: gl.constexpr = acc.type.shape[0]
    heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols = COL0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None] * v_scale
    mask = (heads[:, None] < H) & (cols[None, :] < R)
    if SINGLE:  # the only split: this is the answer
        o_row = Out + b.to(gl.int64) * stride_out_b + heads[:, None] * stride_out_h
        gl.store(o_row + cols[None, :], out.to(Out.dtype.element_ty), mask=mask)
    else:
        o_row = Mid_O + b.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
        gl.store(o_row + cols[None, :], out.to(Mid_O.dtype.element_ty), mask=mask)
        if LSE:
            lse_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=l_i.type.layout)
            gl.store(Mid_Lse + b * stride_lb + lse_heads * stride_lh + split, m_i + gl.log2(l_i), mask=lse_heads < H)


@gluon.jit
def _mla_decode_stage1_gluon(
    Q, Q_pe, Kv_Buf, Kv_Indptr, Kv_Indices, Mid_O, Mid_Lse, Out,
    qk_scale, v_scale, max_splits, min_chunk,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    stride_out_b, stride_out_h,
    H: gl.constexpr, BLOCK_H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr,
    SINGLE: gl.constexpr, FMT: gl.constexpr,
):
    # S = QK^T [heads, keys]: the two warpgroups split the keys; O [heads, R]: they split the latent columns
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, R // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    lat_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])  # 16-byte chunks a thread
    pe_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    lat_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    head_block = gl.program_id(0)
    b, split, kv_start, lo, hi = _program_keys(Kv_Indptr, max_splits, min_chunk, BLOCK_N)
    if lo < hi:
        dtype: gl.constexpr = Q.dtype.element_ty
        kv_dtype: gl.constexpr = Kv_Buf.dtype.element_ty  # uint8 for fp8 bits
        kv_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                     element_bitwidth=kv_dtype.primitive_bitwidth, rank=2)
        pe_smem: gl.constexpr = gl.NVMMASharedLayout(  # 64 one-byte rope values make 64-byte rows
            swizzle_byte_width=min(128, DR * kv_dtype.primitive_bitwidth // 8),
            element_bitwidth=kv_dtype.primitive_bitwidth, rank=2)
        lat_bufs = gl.allocate_shared_memory(kv_dtype, [2, BLOCK_N, R], kv_smem)
        pe_bufs = gl.allocate_shared_memory(kv_dtype, [2, BLOCK_N, DR], pe_smem)
        # fp8: the landed tile's values in `dtype` (one buffer, 72 KB next to two 36 KB fp8 stages); a token 4 KB
        # otherwise (the smallest a 128-byte swizzle takes), never touched
        CVT_N: gl.constexpr = BLOCK_N if FMT > 0 else 16
        CVT_R: gl.constexpr = R if FMT > 0 else 64
        lat_cvt = gl.allocate_shared_memory(dtype, [CVT_N, CVT_R], lat_smem)
        pe_cvt = gl.allocate_shared_memory(dtype, [CVT_N, DR], lat_smem)
        key_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lat_layout))
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        valid = lo + key_rows < hi
        slots = gl.load(Kv_Indices + kv_start + lo + key_rows, mask=valid, other=0)
        _issue_tile(lat_bufs.index(0), pe_bufs.index(0), Kv_Buf, slots, valid, stride_kt, R, DR, lat_layout,
                    pe_layout)  # the first tile's copy before the query's loads: their latencies overlap
        valid = lo + BLOCK_N + key_rows < hi  # the next tile's slot ids, a tile ahead of its copy
        slots = gl.load(Kv_Indices + kv_start + lo + BLOCK_N + key_rows, mask=valid, other=0)

        q_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, lat_layout))
        q_cols = gl.arange(0, R, layout=gl.SliceLayout(0, lat_layout))
        q_lat = gl.load(Q + b.to(gl.int64) * stride_qt + q_heads[:, None] * stride_qh + q_cols[None, :],
                        mask=(q_heads[:, None] < H) & (q_cols[None, :] < R), other=0.0)
        pe_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, pe_layout))
        pe_cols = gl.arange(0, DR, layout=gl.SliceLayout(0, pe_layout))
        q_pe = gl.load(Q_pe + b.to(gl.int64) * stride_pt + pe_heads[:, None] * stride_ph + pe_cols[None, :],
                       mask=(pe_heads[:, None] < H) & (pe_cols[None, :] < DR), other=0.0)
        if FMT == 3:  # latents arrive at 2**-120 of their values: q takes BITS_K_Q_LIFT, qk_scale the rest
            q_lat = (q_lat.to(gl.float32) * BITS_K_Q_LIFT).to(dtype)
            q_pe = (q_pe.to(gl.float32) * BITS_K_Q_LIFT).to(dtype)
        q_lat_s = gl.allocate_shared_memory(dtype, [BLOCK_H, R], lat_smem, q_lat)
        q_pe_s = gl.allocate_shared_memory(dtype, [BLOCK_H, DR], lat_smem, q_pe)

        m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_tile = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        acc = gl.zeros([BLOCK_H, R], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        P_LIFT: gl.constexpr = 64.0 if FMT == 3 else 0.0
        key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        for it in range(n_tiles):
            buf = it % 2
            start = lo + it * BLOCK_N
            async_copy.wait_group(0)  # tile `it` is in shared memory (this thread's copies)
            _cta_barrier()  # every thread's copies, and both warpgroups done with the other buffer
            fence_async_shared()  # the copies (generic proxy) before wgmma's reads (async proxy)
            if it + 1 < n_tiles:
                _issue_tile(lat_bufs.index(1 - buf), pe_bufs.index(1 - buf), Kv_Buf, slots, valid, stride_kt, R,
                            DR, lat_layout, pe_layout)
                valid = start + 2 * BLOCK_N + key_rows < hi
                slots = gl.load(Kv_Indices + kv_start + start + 2 * BLOCK_N + key_rows, mask=valid, other=0)
            lat, pe = _tile_operands(lat_bufs.index(buf), pe_bufs.index(buf), lat_cvt, pe_cvt, dtype, FMT, R)
            if FMT > 0:
                _cta_barrier()  # every thread's converted columns are in shared memory
                fence_async_shared()
            s = warpgroup_mma(q_lat_s, lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe_s, pe.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = gl.where((start + key_cols < hi)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            # FMT 3: weights at 2**64 (P_LIFT) so their products with the 2**-120 latents stay clear of float32
            # subnormals; l carries the same factor, so acc / l loses it and only v_scale's 2**120 remains
            p = gl.exp2(s * qk_scale - (m_new[:, None] - P_LIFT))
            alpha = gl.exp2(m_i - m_new)
            l_tile = l_tile * alpha[:, None] + p  # summed over keys once, after the loop: no cross-warpgroup sum
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, lat, acc)  # synchronous: see the module docstring
        l_i = gl.sum(l_tile, 1)
        _store_result(acc, l_i, m_i - P_LIFT, v_scale, Out, Mid_O, Mid_Lse, b, split, head_block, stride_out_b,
                      stride_out_h, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, H, R, 0, SINGLE, True)
