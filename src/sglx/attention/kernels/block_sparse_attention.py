"""Block-sparse forward attention over a BlockSparseLayout: the one kernel every sparse DiT backend runs.

One program owns BLOCK_M query rows of one (batch row, query head). It walks only the key blocks its query
block lists (`kv_indices[b, h, qb, :kv_counts[b, h, qb]]`), each cut into K_BLOCK / BLOCK_N key tiles, in
one flat loop so Triton can software-pipeline the K/V loads: online softmax in the log2 domain (the scale
carries log2(e)), fp32 accumulation, non-causal. Padding keys (past `seq_len`, or past `k_lengths` of their
block) are masked only when the layout has any (MASK_KEYS), so full layouts pay no per-tile mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.kernels.common import LOG2E, dot, interpreted, tma_rows_descriptor
from sglx.errors import SglxError

HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BlockSparseConfig:
    """Launch parameters; `None` fields are chosen from the layout's blocks, the head dim and the device."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tma: bool | None = None  # K/V tiles through TMA descriptors (CUDA SM90+); None: the device's default


@triton.jit
def _block_sparse_fwd(
    Q, K, V, Out, Kv_Indices, Kv_Counts, K_Lengths, Q_Map,
    qk_scale, seq_len, num_heads,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_ib, stride_ih, stride_iq, stride_cb, stride_ch,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, MASK_KEYS: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    IEEE: tl.constexpr, HAS_QMAP: tl.constexpr,
):
    SUBS: tl.constexpr = K_BLOCK // BLOCK_N
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    head = bh % num_heads
    kv_head = head // GROUP
    m0 = pid_m * BLOCK_M
    q_blk = m0 // Q_BLOCK

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < seq_len
    if HAS_QMAP:  # query row of each slot in q/out (input order); -1 marks a padding slot: nothing to do
        q_rows = tl.load(Q_Map + offs_m, mask=m_mask, other=-1)
        m_mask = q_rows >= 0
    else:
        q_rows = offs_m
    q_ptrs = Q + b.to(tl.int64) * stride_qb + q_rows[:, None].to(tl.int64) * stride_qs + head * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=m_mask[:, None], other=0.0)

    row = Kv_Indices + b * stride_ib + head * stride_ih + q_blk * stride_iq
    count = tl.load(Kv_Counts + b * stride_cb + head * stride_ch + q_blk)
    k_base = K + b.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for it in range(0, count * SUBS):
        kb = tl.load(row + it // SUBS)
        sub = (it % SUBS) * BLOCK_N
        keys = kb * K_BLOCK + sub + offs_n
        k_ptrs = k_base + keys[None, :].to(tl.int64) * stride_ks + offs_d[:, None]
        v_ptrs = v_base + keys[:, None].to(tl.int64) * stride_vs + offs_d[None, :]
        if MASK_KEYS:
            if HAS_LENGTHS:
                valid = (sub + offs_n) < tl.load(K_Lengths + kb)
                valid = valid & (keys < seq_len)
            else:
                valid = keys < seq_len
            k = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
            qk = tl.where(valid[None, :], dot(q, k, IEEE), float("-inf"))
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            qk = dot(q, k, IEEE)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query block with no key block gives zeros
    o_ptrs = Out + b.to(tl.int64) * stride_ob + q_rows[:, None].to(tl.int64) * stride_os + head * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _block_sparse_fwd_tma(
    Q, K_desc, V_desc, Out, Kv_Indices, Kv_Counts, K_Lengths,
    qk_scale, seq_len, num_heads, row_b, row_h, col_h,
    stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_ib, stride_ih, stride_iq,
    stride_cb, stride_ch,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, MASK_KEYS: tl.constexpr, HAS_LENGTHS: tl.constexpr,
):
    """`_block_sparse_fwd` with K/V tiles loaded by TMA: key s of (batch row b, KV head h) is descriptor row
    b * row_b + h * row_h + s at column h * col_h. [B, S, Hkv, D] tensors are [B * S, Hkv * D] descriptors (row_b S,
    row_h 0, col_h D); head-major ones (a [B, Hkv, S, D] buffer seen as [B, S, Hkv, D]) are [B * Hkv * S, D] (row_b
    Hkv * S, row_h S, col_h 0). Rows past the tensor read as zeros; rows of the next (batch row, head) or padding
    are masked like the plain kernel's."""
    SUBS: tl.constexpr = K_BLOCK // BLOCK_N
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    head = bh % num_heads
    kv_head = head // GROUP
    m0 = pid_m * BLOCK_M
    q_blk = m0 // Q_BLOCK
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < seq_len
    q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_m[:, None].to(tl.int64) * stride_qs + head * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    row = Kv_Indices + b * stride_ib + head * stride_ih + q_blk * stride_iq
    count = tl.load(Kv_Counts + b * stride_cb + head * stride_ch + q_blk)
    row0 = b * row_b + kv_head * row_h
    col = kv_head * col_h
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for it in range(0, count * SUBS):
        kb = tl.load(row + it // SUBS)
        sub = (it % SUBS) * BLOCK_N
        start = kb * K_BLOCK + sub
        k = K_desc.load([row0 + start, col])
        v = V_desc.load([row0 + start, col])
        qk = tl.dot(q, tl.trans(k))
        if MASK_KEYS:
            valid = (start + offs_n) < seq_len
            if HAS_LENGTHS:
                valid = valid & ((sub + offs_n) < tl.load(K_Lengths + kb))
            qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_os + head * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_mask[:, None])


def _largest_divisor_tile(block: int, cap: int) -> int:
    """The largest power-of-two tile <= cap (and >= 16, tl.dot's minimum) that divides a layout block."""
    tile = cap
    while tile > 16 and block % tile:
        tile //= 2
    return tile


def _launch(config: BlockSparseConfig, layout: BlockSparseLayout, head_dim: int, device: torch.device
            ) -> tuple[int, int, int, int, bool]:
    """(block_m, block_n, num_warps, num_stages, tma) for this call: the config's fields, else the defaults."""
    tma = False
    if interpreted() or device.type != "cuda":
        cap_m, cap_n, warps, stages = 32, 32, 1, 1
    elif torch.version.hip:  # 64 KB LDS: small tiles, no multi-stage buffering (not measured)
        cap_m, cap_n, warps, stages = 64, 64, 4, 1
    elif torch.cuda.get_device_capability(device)[0] >= 9:
        # H100 sweeps (benchmarks/results/bench_sparse_video_h100.json), D128, 12 heads, STA 3x3x3: 69,120
        # tokens (85%): 128x64 4 warps 2 stages 9.53 ms, 3 stages 10.26, 8 warps 3 stages 11.87, 128x128 14.09;
        # Wan 21x30x52 padded tiles: 128x64 4 warps 2 stages 5.29 ms, 3 stages 7.53, 128x32 6.06, 8 warps 6.06.
        # Session 12 (sweep_block_sparse_h100_s12.json): K/V by TMA is faster on every case swept, D128: STA 85%
        # 128x64 4 warps 2 stages 8.11 ms (plain 9.67), padded 21x30x52 4.41 (5.33), VSA's 64-token cubes 64x64
        # 4 warps 3 stages 2.76 (plain 2 stages 3.35). 32-key tiles and D64 were not swept with TMA: plain loads.
        cap_m, cap_n, warps, stages = 128, 64, 4, 2
        tma = head_dim == 128
    else:
        cap_m, cap_n, warps, stages = (128, 64, 8, 2) if head_dim == 128 else (128, 64, 4, 3)
    block_m = config.block_m or _largest_divisor_tile(layout.q_block, cap_m)
    block_n = config.block_n or _largest_divisor_tile(layout.k_block, cap_n)
    tma = tma and block_n >= 64
    if tma and block_m == 64 and block_n == 64:
        stages = 3  # the 64-token cubes' best TMA launch in session 12's sweep
    return (block_m, block_n, config.num_warps or warps, config.num_stages or stages,
            tma if config.tma is None else config.tma)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
           q_map: torch.Tensor | None = None) -> None:
    """Bad input becomes one SglxError that says what would run, never a failure inside the kernel."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise SglxError(f"block-sparse attention takes q, k, v of shape [B, S, H, D] (k and v alike); got "
                        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, s, hq, d = q.shape
    if q_map is not None:
        if q_map.shape != (layout.seq_len,) or q_map.dtype != torch.int32 or q_map.device != q.device:
            raise SglxError(f"q_map must be int32 [{layout.seq_len}] on {q.device} (one q row or -1 per layout slot); "
                            f"got {q_map.dtype} {tuple(q_map.shape)} on {q_map.device}")
        s = layout.seq_len  # q/out rows are addressed through q_map
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise SglxError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree (same batch and head dim; query "
                        "heads a multiple of key/value heads)")
    allowed = KERNEL_DTYPES + ((torch.float32,) if interpreted() else ())
    if q.dtype not in allowed or k.dtype != q.dtype or v.dtype != q.dtype:
        raise SglxError(f"block-sparse attention takes float16 or bfloat16 q/k/v; got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}. Run the model in bf16 (--dtype bfloat16); the masked reference runs any dtype.")
    if d not in HEAD_DIMS:
        raise SglxError(f"block-sparse attention has kernels for head dims {HEAD_DIMS}; got {d}. Use a dense "
                        "backend (--attention-backend torch_sdpa) for this model.")
    if s != layout.seq_len or k.shape[1] != s:
        raise SglxError(f"the block-sparse layout is for {layout.seq_len} tokens but q/k have {q.shape[1]}/"
                        f"{k.shape[1]}")
    lb, lh = layout.kv_indices.shape[:2]
    if lb not in (1, b) or lh not in (1, hq):
        raise SglxError(f"the layout's batch/head dims ({lb}, {lh}) must be 1 or match q's ({b}, {hq})")
    if layout.q_block % 16 or layout.k_block % 16:
        raise SglxError(f"block-sparse attention needs query/key blocks in multiples of 16; got "
                        f"{layout.q_block}x{layout.k_block}")
    tensors = [layout.kv_indices, layout.kv_counts] + ([layout.k_lengths] if layout.k_lengths is not None else [])
    for t in tensors:
        if t.device != q.device or t.dtype != torch.int32:
            raise SglxError(f"layout tensors must be int32 on {q.device} (q's device); got {t.dtype} on {t.device}")
    if q.device.type != "cuda" and not interpreted():
        raise SglxError(f"block-sparse attention's Triton kernel runs on CUDA GPUs; q is on {q.device}. "
                        "On CPU use sglx.attention.diffusion.sparse.reference.masked_attention.")


def _head_major(t: torch.Tensor) -> bool:
    """t [B, S, H, D] is a view of a contiguous [B, H, S, D] buffer (SVG2's per-head permutations make these)."""
    return t.transpose(1, 2).is_contiguous() and not t.is_contiguous()


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[tuple, tuple[int, int, int]]:
    """TMA descriptors of K and V ([block_n, D] boxes) and the kernel's row/column mapping (see the TMA kernel):
    head-major views are read in place; anything else goes through one contiguous [B * S, Hkv * D] copy at most."""
    b, s, hkv, d = k.shape
    if _head_major(k) and _head_major(v) and k.stride() == v.stride():
        rows = [t.transpose(1, 2).reshape(b * hkv * s, 1, d) for t in (k, v)]  # views: one head a row
        return tuple(tma_rows_descriptor(r, block_n) for r in rows), (hkv * s, s, 0)
    rows = [t.contiguous().view(b * s, hkv, d) for t in (k, v)]
    return tuple(tma_rows_descriptor(r, block_n) for r in rows), (s, 0, d)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                           scale: float | None = None, *, config: BlockSparseConfig = BlockSparseConfig(),
                           out: torch.Tensor | None = None, q_map: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] (fp16/bf16, D 64 or 128) -> [B, S, Hq, D]: each query block attends
    only the key blocks its layout row lists; padding keys never. Rows with no key block give zeros, like
    `masked_attention`, the reference this kernel is tested against.

    With `q_map` (int32 [layout.seq_len]: the q row of each layout slot, -1 for padding slots), q and the
    output stay in their own order ([B, Sq, Hq, D], any Sq) and only k/v are in layout order: a permuting
    backend (STA's tile order) then gathers two tensors instead of three and scatters nothing back. Measured
    on H100 (STA 85%, 69,120 tokens, D128) it was slower than gathering q and scattering out with torch
    (11.28 vs 9.98 ms), so sliding_tile_attn does not use it."""
    _check(q, k, v, layout, q_map)
    b, _, hq, d = q.shape
    s = layout.seq_len
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q) if out is None else out
    if s == 0 or b == 0:
        return out
    block_m, block_n, num_warps, num_stages, tma = _launch(config, layout, d, q.device)
    if layout.q_block % block_m or layout.k_block % block_n:
        raise SglxError(f"kernel tiles {block_m}x{block_n} must divide the layout's blocks "
                        f"{layout.q_block}x{layout.k_block}")
    idx, cnt = layout.kv_indices.contiguous(), layout.kv_counts.contiguous()
    lengths = None if layout.k_lengths is None else layout.k_lengths.contiguous()
    mask_keys = lengths is not None or s % layout.k_block != 0
    scale = d ** -0.5 if scale is None else scale
    grid = (triton.cdiv(s, block_m), b * hq)
    if tma and q_map is None:  # (q_map calls keep the plain kernel)
        hkv = k.shape[2]
        (k_desc, v_desc), (row_b, row_h, col_h) = _kv_descriptors(k, v, block_n)
        _block_sparse_fwd_tma[grid](
            q, k_desc, v_desc, out, idx, cnt, lengths if lengths is not None else cnt, float(scale) * LOG2E, s, hq,
            row_b, row_h, col_h,
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
            idx.stride(0) if idx.shape[0] > 1 else 0, idx.stride(1) if idx.shape[1] > 1 else 0, idx.stride(2),
            cnt.stride(0) if cnt.shape[0] > 1 else 0, cnt.stride(1) if cnt.shape[1] > 1 else 0,
            GROUP=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n, Q_BLOCK=layout.q_block, K_BLOCK=layout.k_block,
            MASK_KEYS=mask_keys, HAS_LENGTHS=lengths is not None, num_warps=num_warps, num_stages=num_stages,
        )
        return out
    _block_sparse_fwd[grid](
        q, k, v, out, idx, cnt, lengths if lengths is not None else cnt, q_map if q_map is not None else cnt,
        float(scale) * LOG2E, s, hq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        idx.stride(0) if idx.shape[0] > 1 else 0, idx.stride(1) if idx.shape[1] > 1 else 0, idx.stride(2),
        cnt.stride(0) if cnt.shape[0] > 1 else 0, cnt.stride(1) if cnt.shape[1] > 1 else 0,
        GROUP=hq // k.shape[2], D=d, BLOCK_M=block_m, BLOCK_N=block_n, Q_BLOCK=layout.q_block,
        K_BLOCK=layout.k_block, MASK_KEYS=mask_keys, HAS_LENGTHS=lengths is not None,
        IEEE=q.dtype == torch.float32, HAS_QMAP=q_map is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out
