"""MLA decode stage 1 for Hopper in Gluon, warp-specialised: two warpgroups that each own every other latent tile.

Why (session 18's parts probe of mla_decode_gluon.py, H200, B64 H128 ctx 4096): that kernel's products alone took
0.157 ms, more than FlashInfer's whole call (0.143). Its two warpgroups split each tile's 64 keys, so each runs QK^T
as m64n32 products that re-read the whole 72 KB query from shared memory: those products are bound by shared-memory
reads, not by the tensor cores. Here (FlashMLA's "seesaw" split) warpgroup w runs QK^T on tile 2j + w alone, as
m64n64 products, and both warpgroups then run PV for both tiles of the pair on their own half of the latent columns
(P of the other tile comes through shared memory). Shared memory: latent query 64 KB, two tiles 144 KB, two P tiles
16 KB; the rope query lives in registers.

There is no room for a second pair of tiles, so the loads overlap the products column by column. Warpgroup w loads,
for the next pair, the columns it was the last to read: its own tile's rope columns and latent half w right after
its local PV, and the other tile's latent half w right after its remote PV. Each tile's halves complete two
mbarriers (one per loading warpgroup, 128 cp.async arrivals each), and QK^T waits for its own half first.

The warpgroups exchange per pair: the tile's row maxima (both compute the same running maximum, so both rescale
their half of O alike), and P. Same contract as `_mla_decode_stage1`: 64 heads a program, 64-key tiles, latents of
512 + 64 in the query's 16-bit dtype, writing the output itself with one split or float32 partials + log2-sum-exp.

Status (H200, session 19, B64 H128 ctx 4096, benchmarks/results/s19/): correct (the GPU tier's real-shape and
CUDA-graph tests pass) but slower than mla_decode_gluon.py, 0.229 against 0.195 ms (FlashInfer 0.143-0.148), so it
runs only on request (`MLADecodeConfig(seesaw=True)`). Its products without the copies take 0.161 ms, no better
than the other kernel's 0.157: the two warpgroups run in lockstep (both wait for each other's maxima every pair, so
neither's softmax overlaps the other's products), and the next pair's copies are issued one PV product before they
are needed, which leaves 0.068 ms of copy latency exposed. Passing the maxima one way (FlashMLA's order) instead
of exchanging them was timed and gained under 1%. What it still lacks against FlashMLA: products left in flight
across the next QK^T's issue, and per-column-chunk barriers so QK^T starts on the first chunk that lands. ptxas
spills about 1 KB a thread (the wgmma descriptors hoisted out of the loop).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sglx.attention.kernels.mla_decode import _program_keys
from sglx.attention.kernels.mla_decode_gluon import _cp_async, _cta_barrier, _store_result

# mbarriers, [10 + 1]: tile w's latent half w + rope landed (loaded by warpgroup w), tile w's other latent half
# landed (loaded by the other warpgroup), warpgroup w's row maxima in shared memory, its P tile in shared memory,
# its softmax denominator in shared memory (once, after the loop), the latent query landed
_OWN = gl.constexpr(0)
_OTHER = gl.constexpr(2)
_MAX = gl.constexpr(4)
_P = gl.constexpr(6)
_SUM = gl.constexpr(8)
_QUERY = gl.constexpr(10)
_WG0 = gl.constexpr(0)
_WG1 = gl.constexpr(1)


@gluon.jit
def _load_rows(buf, Kv_Buf, slots, valid, stride_kt, COL0: gl.constexpr, NCOLS: gl.constexpr,
               layout: gl.constexpr):
    """cp.async of columns [COL0, COL0 + NCOLS) of the KV rows at `slots` (layout's row slice) into buf."""
    cols = gl.arange(0, NCOLS, layout=gl.SliceLayout(0, layout))
    ptrs = Kv_Buf + (slots.to(gl.int64) * stride_kt)[:, None] + COL0 + cols[None, :]
    _cp_async(buf, ptrs, mask=valid[:, None] & (cols[None, :] < NCOLS))


@gluon.jit
def _load_own(own, own_pe, bar, Kv_Buf, slots, valid, stride_kt, W: gl.constexpr, R: gl.constexpr,
              DR: gl.constexpr, layout: gl.constexpr):
    """Warpgroup W's own tile: its latent half W and its rope columns; `bar` gets one arrival a thread on landing."""
    HALF: gl.constexpr = R // 2
    _load_rows(own.slice(W * HALF, HALF, dim=1), Kv_Buf, slots, valid, stride_kt, W * HALF, HALF, layout)
    _load_rows(own_pe, Kv_Buf, slots, valid, stride_kt, R, DR, layout)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _load_other(oth, bar, Kv_Buf, slots, valid, stride_kt, W: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
    """Latent half W of the other warpgroup's tile (what warpgroup W's remote PV reads)."""
    HALF: gl.constexpr = R // 2
    _load_rows(oth.slice(W * HALF, HALF, dim=1), Kv_Buf, slots, valid, stride_kt, W * HALF, HALF, layout)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _tile_slots(Kv_Indices, kv_start, start, hi, rows):
    """Pool slots of the keys [start, start + len(rows)) and which of them exist (< hi)."""
    valid = start + rows < hi
    return gl.load(Kv_Indices + kv_start + start + rows, mask=valid, other=0), valid


@gluon.jit
def _seesaw_warpgroup(
    W: gl.constexpr, q_s, lat_bufs, pe_bufs, p_bufs, m_bufs, l_bufs, bars,
    Q_pe, Kv_Buf, Kv_Indices, Mid_O, Mid_Lse, Out, qk_scale, v_scale,
    head_block, b, split, kv_start, lo, hi,
    stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_b, stride_out_h,
    H: gl.constexpr, BLOCK_H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr,
    SINGLE: gl.constexpr,
):
    """Warpgroup W: QK^T and softmax of tiles 2j + W, PV of both tiles of pair j on latent columns half W."""
    HALF: gl.constexpr = R // 2
    OTHER: gl.constexpr = 1 - W
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte chunks, 4 rows a thread
    vec_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = Q_pe.dtype.element_ty

    own = lat_bufs.index(W)
    own_pe = pe_bufs.index(W)
    oth = lat_bufs.index(OTHER)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
    n_pairs = gl.cdiv(gl.cdiv(hi - lo, BLOCK_N), 2)

    # pair 0: this warpgroup's tile (latent half W + rope) and latent half W of the other tile
    slots, valid = _tile_slots(Kv_Indices, kv_start, lo + W * BLOCK_N, hi, rows)
    _load_own(own, own_pe, bars.index(_OWN + W), Kv_Buf, slots, valid, stride_kt, W, R, DR, ld_layout)
    slots, valid = _tile_slots(Kv_Indices, kv_start, lo + OTHER * BLOCK_N, hi, rows)
    _load_other(oth, bars.index(_OTHER + OTHER), Kv_Buf, slots, valid, stride_kt, W, R, ld_layout)
    # pair 1's slot ids, a pair ahead of their copies
    own_slots, own_valid = _tile_slots(Kv_Indices, kv_start, lo + (2 + W) * BLOCK_N, hi, rows)
    oth_slots, oth_valid = _tile_slots(Kv_Indices, kv_start, lo + (2 + OTHER) * BLOCK_N, hi, rows)

    # the rope query in registers, straight in the layout of QK^T's A operand
    qh = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, qa_layout))
    qc = gl.arange(0, DR, layout=gl.SliceLayout(0, qa_layout))
    q_pe = gl.load(Q_pe + b.to(gl.int64) * stride_pt + qh[:, None] * stride_ph + qc[None, :],
                   mask=(qh[:, None] < H) & (qc[None, :] < DR), other=0.0)

    m_i = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=vec_layout)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_layout)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    mbarrier.wait(bars.index(_QUERY), 0)
    for j in range(n_pairs):
        ph = j & 1
        start = lo + (2 * j + W) * BLOCK_N
        more = j + 1 < n_pairs
        # S = Q K^T of tile 2j + W: the columns this warpgroup loaded first, then the other warpgroup's half
        mbarrier.wait(bars.index(_OWN + W), ph)
        fence_async_shared()
        s = warpgroup_mma(q_s.slice(W * HALF, HALF, dim=1), own.slice(W * HALF, HALF, dim=1).permute((1, 0)),
                          s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_pe, own_pe.permute((1, 0)), s, is_async=True)
        mbarrier.wait(bars.index(_OTHER + W), ph)
        fence_async_shared()
        s = warpgroup_mma(q_s.slice(OTHER * HALF, HALF, dim=1),
                          own.slice(OTHER * HALF, HALF, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where((start + key_cols < hi)[None, :], s, float("-inf"))

        # one running maximum for both warpgroups: each publishes its tile's row maxima and reads the other's
        tile_max = gl.max(s, 1)
        m_bufs.index(W).store(tile_max)
        _cta_barrier()
        mbarrier.arrive(bars.index(_MAX + W), count=1)
        mbarrier.wait(bars.index(_MAX + OTHER), ph)
        m_new = gl.maximum(m_i, gl.maximum(tile_max, m_bufs.index(OTHER).load(vec_layout)) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p16 = p.to(dtype)
        p_bufs.index(W).store(p16)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(bars.index(_P + W), count=1)

        # local PV (P from registers), then this tile's latent half W and rope are free: the next pair's copies
        acc = warpgroup_mma(gl.convert_layout(p16, pa_layout), own.slice(W * HALF, HALF, dim=1), acc)
        if more:
            _load_own(own, own_pe, bars.index(_OWN + W), Kv_Buf, own_slots, own_valid, stride_kt, W, R, DR, ld_layout)
        # remote PV (the other tile's P from shared memory), then that tile's latent half W is free
        mbarrier.wait(bars.index(_P + OTHER), ph)
        acc = warpgroup_mma(p_bufs.index(OTHER), oth.slice(W * HALF, HALF, dim=1), acc)
        if more:
            _load_other(oth, bars.index(_OTHER + OTHER), Kv_Buf, oth_slots, oth_valid, stride_kt, W, R, ld_layout)
            own_slots, own_valid = _tile_slots(Kv_Indices, kv_start, start + 4 * BLOCK_N, hi, rows)
            oth_slots, oth_valid = _tile_slots(Kv_Indices, kv_start, start + (4 + OTHER - W) * BLOCK_N, hi, rows)

    # the softmax denominator is the two warpgroups' sums (the same running maximum scales both)
    l_bufs.index(W).store(l_i)
    _cta_barrier()
    mbarrier.arrive(bars.index(_SUM + W), count=1)
    mbarrier.wait(bars.index(_SUM + OTHER), 0)
    l_all = l_i + l_bufs.index(OTHER).load(vec_layout)
    _store_result(acc, l_all, m_i, v_scale, Out, Mid_O, Mid_Lse, b, split, head_block, stride_out_b, stride_out_h,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh, H, R, W * HALF, SINGLE, W == 0)


@gluon.jit
def _mla_decode_stage1_seesaw(
    Q, Q_pe, Kv_Buf, Kv_Indptr, Kv_Indices, Mid_O, Mid_Lse, Out,
    qk_scale, v_scale, max_splits, min_chunk,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    stride_out_b, stride_out_h,
    H: gl.constexpr, BLOCK_H: gl.constexpr, R: gl.constexpr, DR: gl.constexpr, BLOCK_N: gl.constexpr,
    SINGLE: gl.constexpr, WORKER_REGS: gl.constexpr,
):
    head_block = gl.program_id(0)
    b, split, kv_start, lo, hi = _program_keys(Kv_Indptr, max_splits, min_chunk, BLOCK_N)
    if lo < hi:
        dtype: gl.constexpr = Q.dtype.element_ty
        smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lat_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], smem)
        pe_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DR], smem)
        p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_H, BLOCK_N], smem)
        q_s = gl.allocate_shared_memory(dtype, [BLOCK_H, R], smem)
        m_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_smem)
        l_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_smem)
        bars = gl.allocate_shared_memory(gl.int64, [_QUERY + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_MAX):  # tile halves: one cp.async arrival from each thread of a warpgroup
            mbarrier.init(bars.index(i), count=128)
        for i in gl.static_range(_MAX, _QUERY):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(bars.index(_QUERY), count=128)

        # the latent query: cp.async by this (the default) warpgroup, awaited by both before their first product
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        q_heads = head_block * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_layout))
        q_cols = gl.arange(0, R, layout=gl.SliceLayout(0, ld_layout))
        _cp_async(q_s, Q + b.to(gl.int64) * stride_qt + q_heads[:, None] * stride_qh + q_cols[None, :],
                  mask=(q_heads[:, None] < H) & (q_cols[None, :] < R))
        async_copy.mbarrier_arrive(bars.index(_QUERY), increment_count=False)

        # the argument tuples are written out in the call: a tuple assigned to a name first turns its constexprs
        # into tensors (Triton 3.6)
        gl.warp_specialize([
            (_seesaw_warpgroup, (_WG0, q_s, lat_bufs, pe_bufs, p_bufs, m_bufs, l_bufs, bars, Q_pe, Kv_Buf, Kv_Indices,
                                 Mid_O, Mid_Lse, Out, qk_scale, v_scale, head_block, b, split, kv_start, lo, hi,
                                 stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb,
                                 stride_lh, stride_out_b, stride_out_h, H, BLOCK_H, R, DR, BLOCK_N, SINGLE)),
            (_seesaw_warpgroup, (_WG1, q_s, lat_bufs, pe_bufs, p_bufs, m_bufs, l_bufs, bars, Q_pe, Kv_Buf, Kv_Indices,
                                 Mid_O, Mid_Lse, Out, qk_scale, v_scale, head_block, b, split, kv_start, lo, hi,
                                 stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb,
                                 stride_lh, stride_out_b, stride_out_h, H, BLOCK_H, R, DR, BLOCK_N, SINGLE)),
        ], [4], [WORKER_REGS])
