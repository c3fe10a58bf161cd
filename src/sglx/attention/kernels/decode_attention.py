"""Paged decode attention as split-KV flash-decoding: two Triton kernels merged by log-sum-exp.

Stage 1 gives each program one request, one KV head with a block of its query heads (GQA: the
group's queries are the rows of one tl.dot, so each K/V tile is read once per group) and one split
of the request's keys; it writes the split's normalised output and log2-sum-exp. Stage 2 merges a
request's splits. Keys are gathered through `kv_indices`, so any page size works. A request splits
its (windowed) length into at most `max_splits` chunks of at least `min_chunk` keys: the grid is
fixed by `max_splits` alone, short requests simply leave programs idle.

fp8 KV: one scale per layer folds into the score scale and the output; per-token scales (tensors
`[rows, Hkv]`, see `TokenKVPool`) are loaded with each tile's slots and applied to the [BLOCK_H, BLOCK_N]
score and weight tiles, never to K/V elements: q.(s_n k_n) = s_n (q.k_n), sum p_n s_n v_n = sum (p_n s_n) v_n.
No extra pass over the cache, 8 more bytes per key and head. `DecodeConfig.token_scale_fold` picks how the
V scales reach the fp16 weights (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import (
    LOG2E,
    bits_k_applies,
    bits_k_query,
    bits_k_scores,
    dot,
    e4m3_bits_to_bf16_scaled,
    has_tma,
    kv_format,
    kv_tile_to_compute,
    offsets_fit_int32,
    online_softmax_step,
    padded_dim,
    pv_step,
    scaled_softmax_step,
    slot_offsets,
    tma_rows_descriptor,
    tma_rows_ok,
)

MAX_SPLITS_CAP = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1; `None` fields are chosen from the shapes and the device."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # fewest keys a split is worth. 64 = one tile: under CUDA graphs the grid is sized for the longest
    # context, so a short request at batch 1 spreads over many idle programs anyway (H200 profile:
    # 256 left 8 heads x 2 splits of 4 dependent tiles each, ~8 us per layer for 512 keys)
    min_chunk: int = 64
    waves: int = 4  # stage-1 programs aimed at per SM when choosing the number of splits
    # one split (stage 1 writes the output, no merge) once batch x KV heads reaches this many per SM. H100,
    # Hq32/Hkv8, page 128, contexts 544 / 4096 (benchmarks/results/sweep_decode_splits*_h100_s13.json): B64 (3.9
    # per SM) 66.7 / 369.6 us against 85.5 / 376.2 for the 2 splits + stage-2 merge that `waves` alone gave; B32
    # (1.9) 41.2 / 194.0 against 3 splits' 48.6 / 210.3; B24 (1.45) 34.7 / 158.7 against 41.6 / 189.4
    one_split_rows_per_sm: float = 1.4
    # fp8 KV only: "cast" (Triton's cast; the compiler reads the transposed 8-bit V tile from shared
    # memory one byte at a time), "ptx_v" / "ptx_kv" (inline PTX converts V, or K and V, in registers to
    # float16; needs sm_89+). None: ptx_v where the device has the instruction, else cast. H100 sweep
    # (B64, ctx 4096, page 1): cast 0.279 ms, ptx_kv 0.259, ptx_v 0.235 (bf16 KV 0.382). "bits_k" (e4m3 pool,
    # bfloat16 queries; the default there on sm_89+): V as ptx_v, K's bits moved into bfloat16 by integer
    # operations (`e4m3_bits_to_bf16_scaled`), so K needs no F2F on the conversion unit. H200, session 21, same
    # shape: ptx_v 0.1814-0.1828 ms, bits_k 0.1707-0.1716 (0.66x of bf16's 0.258), ptx_kv 0.229, cast 0.277; bits_k
    # pinned in the load layout (is_pure=False) 0.235 and V by bits too 0.245 (benchmarks/results/s21/)
    fp8_convert: str | None = None
    # batches up to this size merge the splits inside stage 1 (the last split of a request does it) when
    # the caller passes semaphores; larger ones use the second kernel. H100: batch 1 saves the stage-2
    # launch (~80 us a step for Llama-3.1-8B); B64 x ctx 4096 ran 3% slower with the in-kernel merge.
    merge_max_batch: int = 8
    # fp8 per-token scales only: how V's scales s_n reach the weights of the PV dot (K's multiply the scores).
    # "tile_max" (session 6's kernel): w = p * s_n / max(tile's s), the dot's result times that max: a max
    # over the tile's scales across warps, a divide per key, the dot's accumulate split from it (sm_90a,
    # triton 3.6, B64 bench shape: 153 registers, 829 instructions per loop iteration, 12 barriers).
    # "exponent": s_n = 2^e_n f_n split by bit operations, e_n added to the score, the row max taken over
    # both (`scaled_softmax_step`): no reduction beyond softmax's own, the dot accumulates in place, scales
    # loaded unmasked with one address (122 registers, 745 instructions, 9 barriers; one scale per layer:
    # 106, 577, 9). Each row's weights are normalised by its own largest p * s (tile_max: by the tile's
    # largest s, which leaves subnormal fp16 weights where likely keys have small scales). None: "exponent".
    token_scale_fold: str | None = None
    # K/V tiles by TMA (CUDA SM90+): only where every tile is BLOCK_N consecutive slots of one page (the caller's
    # page size a multiple of block_n, no sliding window); None: off (session 12 measures it)
    tma: bool | None = None
    # load each tile's slot ids (and per-slot scales) one tile ahead, so the pipelined K/V gathers never wait on
    # a global load of their addresses. None: on for fp8 KV, except per-token scales outside the 128-key-tile
    # launch (pages under 16 slots, head dims over 128).
    # H200, B64 Hq32/Hkv8 ctx 4096, same call, alternated (benchmarks/results/s17/fp8_decode_prefetch/): one
    # scale a layer 0.216 -> 0.188 ms (pages 1 and 16); per-token scales with 128-key tiles at page 16 0.256 ->
    # 0.220; bf16 0.269 -> 0.319 (slower: a real third K/V stage, fewer programs per SM), hence off there;
    # per-token at page 1: 0.258 -> 0.269 at 3 stages, 0.241 without it at 2 stages (the page-1 default)
    prefetch_slots: bool | None = None

    def __post_init__(self) -> None:
        if self.token_scale_fold is not None and self.token_scale_fold not in TOKEN_SCALE_FOLDS:
            raise ValueError(f"DecodeConfig.token_scale_fold {self.token_scale_fold!r}: choose one of "
                             f"{', '.join(TOKEN_SCALE_FOLDS)}")


def choose_num_kv_splits(batch_size: int, kv_heads: int, max_seq_len: int, sms: int,
                         config: DecodeConfig = DecodeConfig()) -> int:
    """Splits so that batch x kv_heads x splits programs fill the GPU, but no split is shorter than min_chunk."""
    if batch_size == 0:
        return 1
    rows = batch_size * kv_heads
    if config.one_split_rows_per_sm and rows >= config.one_split_rows_per_sm * sms:
        return 1
    by_occupancy = triton.cdiv(config.waves * sms, rows)
    by_length = triton.cdiv(max(max_seq_len, 1), config.min_chunk)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS_CAP))


@triton.jit
def _split_range(seq_len, window, split, max_splits, min_chunk, BLOCK_N: tl.constexpr):
    """Key range [lo, hi) of one split; the same arithmetic in both stages keeps them in agreement."""
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    length = seq_len - start
    n_splits = tl.minimum(tl.maximum(tl.cdiv(length, min_chunk), 1), max_splits)
    chunk = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    return lo, hi, tl.cdiv(length, chunk)  # the last value: how many splits have keys


@triton.jit
def _merge_if_last(o_row, lse_row, out_ptr, semaphore, n_active, head_mask, hd_mask, stride_os,
                   BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    """Split-KV merge by whichever split of (request, head block) finishes last: no second kernel.

    The barrier orders every thread's partial-result stores before the (single-thread) acq_rel ticket;
    the program drawing the last ticket reads all partials (bypassing L1) and resets the semaphore
    to 0 for the next launch (CUDA graph replays included).
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(semaphore, 1, sem="acq_rel", scope="gpu")
    if ticket == n_active - 1:
        offs_s = tl.arange(0, BLOCK_S)
        lse = tl.load(lse_row[:, None] + offs_s[None, :], mask=head_mask[:, None] & (offs_s < n_active)[None, :],
                      other=-1.0e30, cache_modifier=".cg")
        top = tl.max(lse, 1)
        denom = tl.sum(tl.exp2(lse - top[:, None]), 1)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for s in range(0, n_active):
            w = tl.exp2(tl.load(lse_row + s, mask=head_mask, other=-1.0e30, cache_modifier=".cg") - top)
            part = tl.load(o_row + s * stride_os, mask=hd_mask, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * part
        tl.store(out_ptr, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)
        tl.atomic_xchg(semaphore, 0)


@triton.jit
def _tile_slots(Indices, offs, hi, K_Scale, V_Scale, stride_ks, stride_vs, kv_head, SLOT_SCALES: tl.constexpr,
                SLOT64: tl.constexpr):
    """(slot ids, K scales, V scales) of the keys `offs` (past `hi`: slot 0); without per-slot scales the scales are
    the ids again (unused). Masked keys read slot 0's scales: whatever they hold, unused."""
    slots = slot_offsets(tl.load(Indices + offs, mask=offs < hi, other=0), SLOT64)
    k_s = slots
    v_s = slots
    if SLOT_SCALES:
        k_s = tl.load(K_Scale + slots * stride_ks + kv_head)
        v_s = tl.load(V_Scale + slots * stride_vs + kv_head)
    return slots, k_s, v_s


@triton.jit
def _decode_stage1(
    Q, K_Buf, V_Buf, Kv_Indptr, Kv_Indices, Mid_O, Mid_Lse, Out, Semaphores, K_Scale, V_Scale,
    qk_scale, logit_cap, v_scale, window, max_splits, min_chunk,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, stride_vs,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
    MERGE_HERE: tl.constexpr, BLOCK_S: tl.constexpr, TMA: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, CVT: tl.constexpr, SLOT_SCALES: tl.constexpr,
    SCALE_FOLD: tl.constexpr, PREFETCH: tl.constexpr, SLOT64: tl.constexpr,
):
    kv_head = tl.program_id(0) // HEAD_BLOCKS  # heads vary fastest: neighbours read the same tokens' rows
    head_block = tl.program_id(0) % HEAD_BLOCKS
    b = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(Kv_Indptr + b)
    seq_len = tl.load(Kv_Indptr + b + 1) - kv_start
    lo, hi, n_active = _split_range(seq_len, window, split, max_splits, min_chunk, BLOCK_N)
    if lo < hi:
        offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_mask = offs_d < D
        dv_mask = offs_dv < DV
        q = tl.load(Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_mask[:, None] & d_mask[None, :], other=0.0)
        if CVT == 2:
            q = q.to(tl.float16)
        elif CVT == 3:  # K arrives as bf16 at 2**-120 of its value: q takes 2**64 (exact), the scores 2**56
            q = bits_k_query(q)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        if PREFETCH:  # slot ids (and per-slot scales) one tile ahead: no gather waits on a load of its addresses
            next_slots, next_k_s, next_v_s = _tile_slots(Kv_Indices + kv_start, lo + tl.arange(0, BLOCK_N), hi, K_Scale,
                                                         V_Scale, stride_ks, stride_vs, kv_head, SLOT_SCALES, SLOT64)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            if TMA:  # the tile is BLOCK_N consecutive slots of one page: one box each for K and V
                first = tl.load(Kv_Indices + kv_start + start)
                slots = slot_offsets(first, SLOT64) + tl.arange(0, BLOCK_N)  # past hi: the same page's later slots
                k = K_Buf.load([first, kv_head * D])
            else:
                if PREFETCH:
                    slots, k_s, v_s = next_slots, next_k_s, next_v_s
                    next_slots, next_k_s, next_v_s = _tile_slots(Kv_Indices + kv_start, offs_n + BLOCK_N, hi, K_Scale,
                                                                 V_Scale, stride_ks, stride_vs, kv_head, SLOT_SCALES,
                                                                 SLOT64)
                else:
                    slots = slot_offsets(tl.load(Kv_Indices + kv_start + offs_n, mask=n_mask, other=0), SLOT64)
                # K as [keys, D] rows like V: one layout of the slot ids for both gathers (SASS: 577 -> 532
                # instructions a tile for fp8 KV with one scale a layer, with int32 offsets)
                k = tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                            mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if CVT == 3:  # noqa: SIM108 - constexpr branch, resolved at compile time
                k = e4m3_bits_to_bf16_scaled(k)
            else:
                k = kv_tile_to_compute(k, FMT, CVT == 2, q.dtype)
            qk = dot(q, tl.trans(k), IEEE)
            if CVT == 3:
                qk = bits_k_scores(qk)
            if SLOT_SCALES and SCALE_FOLD == 1:  # V scales' exponents join the scores (scaled_softmax_step)
                if not PREFETCH:  # masked keys read slot 0's scales: whatever they hold, unused
                    scale_row = slots * stride_ks + kv_head
                    k_s = tl.load(K_Scale + scale_row)
                    v_s = tl.load(V_Scale + scale_row)
                p, alpha, m_new, l_i = scaled_softmax_step(qk, n_mask[None, :], k_s, v_s, m_i, l_i, qk_scale,
                                                           logit_cap, SOFTCAP)
            else:
                if SLOT_SCALES and PREFETCH:
                    qk = qk * tl.where(n_mask, k_s, 0.0)[None, :]
                elif SLOT_SCALES:
                    qk = qk * tl.load(K_Scale + slots * stride_ks + kv_head, mask=n_mask, other=0.0)[None, :]
                p, alpha, m_new, l_i = online_softmax_step(qk, n_mask[None, :], m_i, l_i, qk_scale,
                                                           logit_cap, True, SOFTCAP)
            if TMA:
                v = V_Buf.load([first, kv_head * DV])
            else:
                v = tl.load(V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                            mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
            v = kv_tile_to_compute(v, FMT, CVT >= 1, q.dtype)
            if TMA:  # rows past hi hold whatever the page holds (never-written bits may be NaN): zero weights
                v = tl.where(n_mask[:, None], v, 0.0).to(v.dtype)  # are not enough, zero the rows
            v_scale_n = alpha  # unused unless tile_max folding
            if SLOT_SCALES and SCALE_FOLD == 0:
                if PREFETCH:
                    v_scale_n = tl.where(n_mask, v_s, 0.0)
                else:
                    v_scale_n = tl.load(V_Scale + slots * stride_vs + kv_head, mask=n_mask, other=0.0)
            acc = pv_step(acc, alpha, p, v, v_scale_n, SLOT_SCALES and SCALE_FOLD == 0, IEEE)
            m_i = m_new

        out = acc / l_i[:, None] * v_scale
        hd_mask = head_mask[:, None] & dv_mask[None, :]
        out_ptr = Out + b.to(tl.int64) * stride_out_t + heads[:, None] * stride_out_h + offs_dv[None, :]
        if MERGE_HERE and n_active == 1:  # the only split: its output is final
            tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=hd_mask)
        else:
            o_row = Mid_O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
            lse_row = Mid_Lse + b * stride_lb + heads * stride_lh
            tl.store(o_row + split * stride_os, out, mask=hd_mask)
            tl.store(lse_row + split, m_i + tl.log2(l_i), mask=head_mask)
            if MERGE_HERE:
                _merge_if_last(o_row, lse_row, out_ptr, Semaphores + b * tl.num_programs(0) + tl.program_id(0),
                               n_active, head_mask, hd_mask, stride_os, BLOCK_H, BLOCK_DV, BLOCK_S)


@triton.jit
def _decode_stage2(
    Mid_O, Mid_Lse, Out, Kv_Indptr, window, max_splits, min_chunk,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Kv_Indptr + b + 1) - tl.load(Kv_Indptr + b)
    splits = tl.arange(0, BLOCK_S)
    lo, hi, _ = _split_range(seq_len, window, splits, max_splits, min_chunk, BLOCK_N)
    valid = (lo < hi) & (splits < max_splits)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    lse = tl.load(Mid_Lse + b * stride_lb + h * stride_lh + splits, mask=valid, other=float("-inf"))
    parts = tl.load(Mid_O + b.to(tl.int64) * stride_ob + h * stride_oh + splits[:, None] * stride_os
                    + offs_dv[None, :], mask=valid[:, None] & dv_mask[None, :], other=0.0)
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = tl.where(valid, weights, 0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + b.to(tl.int64) * stride_out_t + h * stride_out_h + offs_dv, out.to(Out.dtype.element_ty),
             mask=dv_mask)


FP8_CONVERTS = {"cast": 0, "ptx_v": 1, "ptx_kv": 2, "bits_k": 3}
TOKEN_SCALE_FOLDS = {"tile_max": 0, "exponent": 1}
# exponent does less work by static count (sm_90a SASS: 745 vs 829 instructions a loop, 122 vs 153 registers) and in
# the H100's same-run A/B (session 7, B64 Hq32/Hkv8 ctx 4096, benchmarks/results/fp8_kv_decode_h100_s7.json) it took
# 0.2664 / 0.2627 ms at page 1 / 16 against tile_max's 0.3383 / 0.3168 ms, with the same error (7.3e-04); it passed
# tests/gpu/test_fp8_kv_gpu.py on that GPU. tile_max stays selectable (DecodeConfig.token_scale_fold).
DEFAULT_TOKEN_SCALE_FOLD = "exponent"


def _fp8_convert_code(config: DecodeConfig, fmt: int, q_dtype: torch.dtype, device: torch.device,
                      interpret: bool) -> int:
    if fmt == 0:
        return 0
    if config.fp8_convert is not None:
        if config.fp8_convert == "bits_k" and not bits_k_applies(fmt, q_dtype):
            raise ValueError(f"fp8_convert={config.fp8_convert!r} needs an e4m3 pool and bfloat16 queries (got KV "
                             f"format {fmt}, queries {q_dtype}); use fp8_convert='ptx_kv' for float16 models")
        return FP8_CONVERTS[config.fp8_convert]
    if interpret or device.type != "cuda" or torch.version.hip:
        return 0
    if torch.cuda.get_device_capability(device) < (8, 9):
        return 0
    return 3 if bits_k_applies(fmt, q_dtype) else 1


def _token_scale_fold_code(config: DecodeConfig) -> int:
    return TOKEN_SCALE_FOLDS[config.token_scale_fold or DEFAULT_TOKEN_SCALE_FOLD]


def _head_blocking(group: int) -> tuple[int, int]:
    """(BLOCK_H, head blocks): a KV head's query group as the rows of one tl.dot (at least 16, at most 64)."""
    block_h = max(16, min(64, triton.next_power_of_2(group)))
    return block_h, triton.cdiv(group, block_h)


def semaphore_count(batch_size: int, q_heads: int, kv_heads: int) -> int:
    """Entries of the `semaphores` buffer a decode launch of this shape uses (one per request and head block)."""
    return batch_size * kv_heads * _head_blocking(q_heads // kv_heads)[1]


def _prefetch_slots(config: DecodeConfig, fmt: int, slot_scales: bool, wide: bool, interpret: bool) -> bool:
    """Whether stage 1 loads slot ids (and scales) a tile ahead (`DecodeConfig.prefetch_slots`): by default for fp8
    KV with one scale a layer, and with per-token scales where the launch is `wide`."""
    if config.prefetch_slots is not None:
        return config.prefetch_slots
    return not interpret and fmt != 0 and (not slot_scales or wide)


def _stage1_launch(config: DecodeConfig, head_dim: int, interpret: bool, slot_scales: bool,
                   wide: bool) -> tuple[int, int, int]:
    """(block_n, warps, stages); `wide`: per-token fp8 scales on pages of 16+ slots take 128-key tiles (with slot
    ids a tile ahead: see DecodeConfig)."""
    if interpret:
        return config.block_n or 16, 1, 1
    block_n = config.block_n or (128 if wide else 32 if head_dim > 128 else 64)
    # 3 stages keep two gathered K/V tiles in flight (H100 sweep: 2.85 vs 2.65 TB/s with 2 stages); per-token
    # scales on smaller pages do better with 2 (H100 session 7: 0.2613 vs 0.2664 ms; H200 session 17: 0.241 vs 0.258)
    stages = 1 if torch.version.hip else 2 if slot_scales and not wide else 3
    return block_n, config.num_warps or 4, config.num_stages or stages


def _tma_ok(config: DecodeConfig, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_size: int, block_n: int,
            window: int, interpret: bool) -> bool:
    """Whether stage 1 may load K/V tiles by TMA: asked for, every tile one page's consecutive slots (page size a
    multiple of block_n, no window: split starts stay tile-aligned), pool rows a descriptor can read
    (`tma_rows_ok`), and a device with TMA (or the interpreter)."""
    if not config.tma or window or page_size % block_n or not (tma_rows_ok(k_buffer) and tma_rows_ok(v_buffer)):
        return False
    return interpret or has_tma(k_buffer.device)


def decode_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor,
    scaling: float, *, sliding_window: int | None = None, logit_cap: float = 0.0,
    k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, fp8_dtype: torch.dtype | None = None,
    config: DecodeConfig = DecodeConfig(), interpret: bool = False, semaphores: torch.Tensor | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """One query per request: q [bs, Hq, D], out [bs, Hq, Dv]; mid_o [bs, Hq, max_splits, Dv] and
    mid_lse [bs, Hq, max_splits] (float32) are scratch whose split dimension sets `max_splits`.

    semaphores: int32 zeros with at least `semaphore_count(bs, Hq, Hkv)` entries, left zero again by
    every launch (keep one buffer per stream). With them (and bs <= config.merge_max_batch) the last
    split of each request merges the splits in the same kernel; otherwise a second kernel does.

    k_scale/v_scale: one float per layer, or float32 `[rows, Hkv]` per-slot scales of an fp8 pool
    (`TokenKVPool.per_token_scales`; q must then already be in the pool's rotated key basis). Per-slot scales
    of the slots attention reads are positive normal floats (the pool's are at least `MIN_SCALE`); slot 0's
    row may hold anything (masked lanes of a tile point at it)."""
    bs, hq, dim = q.shape
    hkv = k_buffer.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    dim_v = v_buffer.shape[-1]
    max_splits = mid_lse.shape[-1]
    if bs == 0:
        return out
    group = hq // hkv
    block_h, head_blocks = _head_blocking(group)
    softcap = logit_cap > 0
    slot_scales = isinstance(k_scale, torch.Tensor)
    wide = slot_scales and page_size >= 16 and dim <= 128
    block_n, num_warps, num_stages = _stage1_launch(config, dim, interpret, slot_scales, wide)
    if slot_scales:
        k_scales, v_scales = k_scale, v_scale
        k_scale = v_scale = 1.0
        if k_scales.stride() != v_scales.stride() or k_scales.stride(-1) != 1:
            raise ValueError(f"per-slot K/V scales need one row-major layout (strides {k_scales.stride()} and "
                             f"{v_scales.stride()}); pass TokenKVPool's k_scale/v_scale tensors")
    else:
        k_scales = v_scales = mid_lse  # unused
    qk_scale = scaling * k_scale * (1.0 if softcap else LOG2E)
    window = int(sliding_window or 0)
    fmt = kv_format(fp8_dtype)
    ieee = q.dtype == torch.float32
    # one split: stage 1 writes the output (its only split is final); no semaphore is touched then
    merge_here = max_splits == 1 or (semaphores is not None and bs <= config.merge_max_batch)
    if merge_here and semaphores is not None and semaphores.numel() < (need := semaphore_count(bs, hq, hkv)):
        raise ValueError(f"semaphores hold {semaphores.numel()} entries; this launch needs {need}")
    tma = _tma_ok(config, k_buffer, v_buffer, page_size, block_n, window, interpret)
    k_arg, v_arg = ((tma_rows_descriptor(k_buffer, block_n), tma_rows_descriptor(v_buffer, block_n)) if tma
                    else (k_buffer, v_buffer))
    _decode_stage1[(hkv * head_blocks, bs, max_splits)](
        q, k_arg, v_arg, kv_indptr, kv_indices, mid_o, mid_lse, out,
        semaphores if merge_here and semaphores is not None else mid_lse,
        k_scales, v_scales, qk_scale, float(logit_cap), float(v_scale), window, max_splits, config.min_chunk,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_scales.stride(0), v_scales.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), MERGE_HERE=merge_here, BLOCK_S=triton.next_power_of_2(max_splits), TMA=tma,
        GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks, D=dim, DV=dim_v, BLOCK_D=padded_dim(dim),
        BLOCK_DV=padded_dim(dim_v), BLOCK_N=block_n, FMT=fmt, SOFTCAP=softcap, IEEE=ieee,
        CVT=_fp8_convert_code(config, fmt, q.dtype, q.device, interpret), SLOT_SCALES=slot_scales,
        SCALE_FOLD=_token_scale_fold_code(config) if slot_scales else 0,
        PREFETCH=not tma and _prefetch_slots(config, fmt, slot_scales, wide, interpret),
        SLOT64=not offsets_fit_int32(k_buffer, v_buffer), num_warps=num_warps,
        num_stages=num_stages,
    )
    if merge_here:
        return out
    _decode_stage2[(bs, hq)](
        mid_o, mid_lse, out, kv_indptr, window, max_splits, config.min_chunk,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        DV=dim_v, BLOCK_DV=padded_dim(dim_v), BLOCK_S=triton.next_power_of_2(max_splits), BLOCK_N=block_n,
        num_warps=4 if not interpret else 1,
    )
    return out
