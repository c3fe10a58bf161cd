"""MLA decode (absorbed weights) as split-KV flash-decoding over the paged latent cache.

Each cached token holds one latent row [c_kv (R), k_pe (DR)] shared by every head. The query of head h
is [q_nope_h W_UK_h (R), q_pe_h (DR)], so a score is q_lat . c + q_pe . k_pe and the value is c itself:
stage 1 loads each latent tile ONCE and uses it twice, as the keys of both dots and (transposed) as the
values, for a block of heads (the rows of one tl.dot) and one split of a request's keys, writing the
split's normalised latent output and log2-sum-exp; stage 2 merges the splits, one program per (request,
head, 128 latent columns) so a merge over many splits never holds a [splits, 512] tile in one program.
With one split, stage 1 writes the output itself and stage 2 is skipped (no float32 partials round trip).

Launch defaults (`resolve_config`, H100 sweep of 2026-11-23, B64 H128 ctx 4096, page 1, bf16): with 64+
heads on SM90, 64 heads per program with 8 warps (wgmma; 4 warps spill), 64-key tiles, 2 stages, and one
split once the batch's programs fill ~90% of the SMs (0.330 ms; 16-head blocks with 4 warps: 1.039 ms;
FlashInfer MLA 0.155 ms in the same run). fp8 latents take the same wide launch since session 7 (0.492 ms
vs 1.383 ms for the 16-head launch, same error, H100 B64 H128 ctx 4096; benchmarks/results/
mla_decode_b64_h100_s7.json). Otherwise (few heads, other GPUs) 16-head blocks, 32-key tiles, 4 warps.
The latent (R) and rope (DR) parts are separate blocks, so 512 + 64 is not padded to 1024. Slots come from
`kv_indices`, so any page size works; fp8 latents dequantize in registers.

On SM90 the 64-head launch runs stage 1 as a Gluon kernel instead (mla_decode_gluon.py, `MLADecodeConfig.gluon`):
Triton's pipeliner cannot overlap a tile's copy with the previous tile's work at two stages, and a third does not
fit. H200, session 18, B64 H128 ctx 4096: bf16 0.303 -> 0.195 ms (FlashInfer 0.143), fp8 latents 0.440 -> 0.339.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import (
    BITS_K_SCORE_SCALE,
    BITS_K_VALUE_SCALE,
    LOG2E,
    bits_k_applies,
    dot,
    kv_format,
    kv_tile_to_compute,
    num_sms,
    online_softmax_step,
    padded_dim,
)
from sglx.attention.kernels.decode_attention import MAX_SPLITS_CAP, DecodeConfig, _split_range, choose_num_kv_splits

__all__ = ["MLADecodeConfig", "choose_num_kv_splits", "head_blocks", "mla_decode_attention", "mla_num_splits",
           "resolve_config", "split_chunk", "use_gluon", "wide_launch"]

# wgmma needs 64-row tiles; 8 warps keep the [64, 512] accumulator in registers. With fp8 latents it also
# compiles (sm_90a, triton 3.6: 255 registers, ~400 bytes spilled, 184 KB shared memory) and on the H100 (session
# 7, B64 H128 ctx 4096) it took 0.492 ms against the 16-head launch's 1.383 ms with the same error, so it is the
# fp8 default too (benchmarks/bench_mla_decode.py still times both).
# Its split count never starts a second, partial wave of programs (`mla_num_splits`), and a split takes at least
# 128 keys: H200, session 19, ctx 4096, one CUDA graph of 8 layers (benchmarks/results/s19/mla_splits_h128_h200_s19
# .json), us a call at the old / new split count: batch 1 64 -> 32 splits 20.0 / 18.0, batch 2 33 -> 32 24.0 / 23.1,
# batch 4 17 -> 16 31.7 / 30.6, batch 8 9 -> 8 48.0 / 47.2, batch 16 5 -> 4 110.3 / 80.0, batch 32 3 -> 2
# 179.7 / 115.0; each new count was the fastest of the 12 timed (1 to 64 splits), and of 7 at ctx 1024 (batch 32:
# 3 -> 2 splits 93.0 / 50.6 us; mla_splits_check_h200_s19.json).
WIDE_LAUNCH = dict(block_h=64, block_n=64, num_warps=8, num_stages=2, waves=1, min_chunk=128)


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of stage 1; None fields are chosen by `resolve_config` from heads, KV dtype and device."""

    block_h: int | None = None  # heads per program (the rows of each tl.dot)
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    min_chunk: int | None = None  # fewest keys a split is worth (None: `split_chunk` picks by batch)
    # None min_chunk: 32-key splits while batch x head blocks is at most this, 64 above (see resolve_config)
    small_batch_programs: int = 8
    waves: int | None = None  # stage-1 programs aimed at per SM when choosing the number of splits
    one_split_fill: float = 0.9  # one split once bs x head blocks programs reach this fraction of the SMs
    num_splits: int | None = None  # an explicit split count (sweeps); None: `mla_num_splits`' rule
    # stage 1 as the Gluon kernel (mla_decode_gluon.py: latent tiles double-buffered by hand) instead of tl.dot's:
    # True requires it (ValueError where it does not apply), False never; None: where it applies (the 64-head
    # launch on SM90, bf16/fp16 queries, latents of 512 + 64 in their dtype or fp8) with the Triton release it was
    # verified on (`GLUON_TRITON`)
    gluon: bool | None = None
    # within the Gluon route, bf16/fp16 latents: the warp-specialised kernel (mla_decode_seesaw.py: each warpgroup
    # owns every other tile) instead of mla_decode_gluon.py's. Slower on the H200 (session 19): True takes it (for
    # timing and for work on it), None and False never do
    seesaw: bool | None = None


def resolve_config(config: MLADecodeConfig, heads: int, fp8: bool, device: torch.device,
                   interpret: bool = False) -> MLADecodeConfig:
    """The config with every None field set (see the module docstring for where the defaults come from)."""
    wide = (not interpret and heads >= 64 and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))
    if interpret:
        defaults = dict(block_h=16, block_n=16, num_warps=1, num_stages=1, waves=4, min_chunk=64)
    elif wide:
        defaults = WIDE_LAUNCH
    else:
        # min_chunk stays None: `split_chunk` gives small batches 32-key splits. H100, 16 heads (DeepSeek-V2-Lite),
        # one graph of a call per layer (session 15, benchmarks/results/mla_small_batch_h100_s15.json and
        # mla_batches_h100_s15.json), 544 keys, us a call with 32- / 64-key splits: batch 1 9.50 / 12.13, batch 2
        # 9.94 / 12.41, batch 8 13.85 / 14.29, batch 16 20.91 / 18.34, batch 32 32.49 / 27.37
        defaults = dict(block_h=16, block_n=32, num_warps=4, num_stages=1 if torch.version.hip else 2, waves=4)
    return replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})


def wide_launch(config: MLADecodeConfig = MLADecodeConfig()) -> MLADecodeConfig:
    """`config` with the 64-head launch in its None fields, whatever the KV dtype (to time it on fp8 latents)."""
    return replace(config, **{k: v for k, v in WIDE_LAUNCH.items() if getattr(config, k) is None})


def _block_h(heads: int, config: MLADecodeConfig) -> int:
    return min(config.block_h or 16, max(16, triton.next_power_of_2(heads)))


def head_blocks(heads: int, config: MLADecodeConfig = MLADecodeConfig()) -> int:
    """Stage-1 programs per request and split: what the split count should be sized by."""
    return triton.cdiv(heads, _block_h(heads, config))


def split_chunk(config: MLADecodeConfig, batch_size: int, heads: int) -> int:
    """Fewest keys a split takes: the config's min_chunk, else 32 while the batch's stage-1 programs (batch x
    head blocks) are at most `small_batch_programs` (latency-bound: more, shorter splits win), else 64."""
    if config.min_chunk is not None:
        return config.min_chunk
    return 32 if batch_size * head_blocks(heads, config) <= config.small_batch_programs else 64


def mla_num_splits(batch_size: int, heads: int, max_seq_len: int, sms: int, config: MLADecodeConfig) -> int:
    """KV splits: one when the batch's programs already (nearly) fill the GPU (splitting would only add the
    float32 partials and a merge), else enough to fill it (`choose_num_kv_splits`). The 64-head launch runs one
    program per SM, so there the count is rounded down, not up: a second wave of a few programs would cost as much
    as the first (see WIDE_LAUNCH)."""
    if config.num_splits is not None:
        return max(1, min(config.num_splits, MAX_SPLITS_CAP))
    blocks = head_blocks(heads, config)
    if batch_size * blocks >= config.one_split_fill * sms:
        return 1
    # MLA's one-split rule is the one above (its programs are one per SM), so the MHA rule is off here;
    # `config` is resolved (`resolve_config` sets waves)
    chunk = split_chunk(config, batch_size, heads)
    if _block_h(heads, config) >= 64:
        by_occupancy = config.waves * sms // (batch_size * blocks)  # type: ignore[operator]
        return max(1, min(by_occupancy, triton.cdiv(max(max_seq_len, 1), chunk), MAX_SPLITS_CAP))
    mha = DecodeConfig(min_chunk=chunk, waves=config.waves, one_split_rows_per_sm=0.0)  # type: ignore[arg-type]
    return choose_num_kv_splits(batch_size, blocks, max_seq_len, sms, mha)


@triton.jit
def _mla_merge_kernel(Mid_O, Mid_Lse, Out, Kv_Indptr, max_splits, min_chunk,
                      stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
                      H: tl.constexpr, R: tl.constexpr, BLOCK_HM: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 2: out[b, heads, cols] = the splits' partial outputs weighted by their sum-exp (log2 domain), for
    BLOCK_HM heads x BLOCK_DV columns a program, every split's rows loaded at once (see `merge_launch`)."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    seq_len = tl.load(Kv_Indptr + b + 1) - tl.load(Kv_Indptr + b)
    splits = tl.arange(0, BLOCK_S)
    lo, hi, _ = _split_range(seq_len, 0, splits, max_splits, min_chunk, BLOCK_N)
    valid = ((lo < hi) & (splits < max_splits))[None, :] & (heads < H)[:, None]  # [heads, splits]
    dv_mask = offs_dv < R
    lse = tl.load(Mid_Lse + b * stride_lb + heads[:, None] * stride_lh + splits[None, :], mask=valid,
                  other=float("-inf"))
    weights = tl.where(valid, tl.exp2(lse - tl.max(lse, 1)[:, None]), 0.0)
    rows = Mid_O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + splits[None, :] * stride_os
    parts = tl.load(rows[:, :, None] + offs_dv[None, None, :], mask=valid[:, :, None] & dv_mask[None, None, :],
                    other=0.0).to(tl.float32)  # [heads, splits, cols]
    out = tl.sum(parts * weights[:, :, None], 1) / tl.maximum(tl.sum(weights, 1), 1.0e-30)[:, None]
    tl.store(Out + b.to(tl.int64) * stride_out_t + heads[:, None] * stride_out_h + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=(heads < H)[:, None] & dv_mask[None, :])


# elements of [heads, splits, cols] a merge program loads at once. H200, 128 heads, latent 512, ctx 4096
# (benchmarks/results/s22/mla_profile_*): one program per (request, head, 128 columns) left programs of 512-2048
# floats, and at batch 16 / 4 splits the merge took 25 us of the 80 us call (8,192 programs: launching them was the
# cost, 16.8 MB at 0.7 TB/s); programs of this many elements, while the grid still has at least one per SM
MERGE_TILE = 8192


def merge_launch(bs: int, h: int, r: int, block_s: int, sms: int) -> tuple[int, int]:
    """(heads, columns) a merge program takes: columns up to the padded latent, then heads up to 8, each doubling
    only while the program's tile stays within MERGE_TILE and the grid keeps at least `sms` programs."""
    r_pad = padded_dim(r)
    heads, cols = 1, min(128, r_pad)

    def programs(hm: int, dv: int) -> int:
        return bs * triton.cdiv(h, hm) * triton.cdiv(r, dv)

    while cols < r_pad and block_s * heads * cols * 2 <= MERGE_TILE and programs(heads, cols * 2) >= sms:
        cols *= 2
    while heads < min(8, h) and block_s * heads * cols * 2 <= MERGE_TILE and programs(heads * 2, cols) >= sms:
        heads *= 2
    return heads, cols


@triton.jit
def _program_keys(Kv_Indptr, max_splits, min_chunk, BLOCK_N: tl.constexpr):
    """(request, split, its first entry in kv_indices, key range [lo, hi)) of this stage-1 program (grid: head
    blocks, requests, splits); shared by the tl.dot and the Gluon kernels."""
    b = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(Kv_Indptr + b)
    seq_len = tl.load(Kv_Indptr + b + 1) - kv_start
    lo, hi, _ = _split_range(seq_len, 0, split, max_splits, min_chunk, BLOCK_N)
    return b, split, kv_start, lo, hi


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b as one MMA chain (the accumulator stays in the MMA registers: no separate add)."""
    if IEEE:
        return tl.dot(a, b, acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc)


@triton.jit
def _mla_decode_stage1(
    Q, Q_pe, Kv_Buf, Kv_Indptr, Kv_Indices, Mid_O, Mid_Lse, Out,
    qk_scale, v_scale, max_splits, min_chunk,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    stride_out_b, stride_out_h,
    H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, IEEE: tl.constexpr,
    SINGLE: tl.constexpr,
):
    head_block = tl.program_id(0)
    b, split, kv_start, lo, hi = _program_keys(Kv_Indptr, max_splits, min_chunk, BLOCK_N)
    if lo < hi:
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_DR)
        r_mask = offs_r < R
        p_mask = offs_p < DR
        q_row = Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + offs_r[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
        q_pe = tl.load(Q_pe + b.to(tl.int64) * stride_pt + heads[:, None] * stride_ph + offs_p[None, :],
                       mask=head_mask[:, None] & p_mask[None, :], other=0.0)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        # each tile's slot ids are loaded one iteration early: the copy of the next tile, which the pipeliner
        # issues at the end of an iteration, then never waits on a global load of its addresses (H200, session
        # 17: B64 H128 ctx 4096 0.325 -> 0.304 ms; batch 1, 16 heads, 544 keys 9.66 -> 9.36 us a call)
        next_slots = tl.load(Kv_Indices + kv_start + lo + tl.arange(0, BLOCK_N), mask=lo + tl.arange(0, BLOCK_N) < hi,
                             other=0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            slots = next_slots.to(tl.int64)
            next_slots = tl.load(Kv_Indices + kv_start + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < hi, other=0)
            rows = Kv_Buf + slots[None, :] * stride_kt
            c = tl.load(rows + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None], other=0.0)  # [R, N]
            c = kv_tile_to_compute(c, FMT, False, q_lat.dtype)
            k_pe = tl.load(rows + R + offs_p[:, None], mask=n_mask[None, :] & p_mask[:, None], other=0.0)
            k_pe = kv_tile_to_compute(k_pe, FMT, False, q_lat.dtype)
            qk = _dot_acc(q_pe, k_pe, dot(q_lat, c, IEEE), IEEE)  # one accumulator for both parts
            p, alpha, m_new, l_i = online_softmax_step(qk, n_mask[None, :], m_i, l_i, qk_scale, 0.0, True, False)
            acc = _dot_acc(p.to(c.dtype), tl.trans(c), acc * alpha[:, None], IEEE)
            m_i = m_new

        out = acc / l_i[:, None] * v_scale
        if SINGLE:  # the only split: this is the answer
            o_row = Out + b.to(tl.int64) * stride_out_b + heads[:, None] * stride_out_h
            tl.store(o_row + offs_r[None, :], out.to(Out.dtype.element_ty), mask=head_mask[:, None] & r_mask[None, :])
        else:
            o_row = Mid_O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
            tl.store(o_row + offs_r[None, :], out.to(Mid_O.dtype.element_ty), mask=head_mask[:, None] & r_mask[None, :])
            tl.store(Mid_Lse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=head_mask)


# Triton releases whose Gluon kernel ran on the lent GPU (H200, session 18); later ones compile it (CPU tier) but
# have not run it, so `gluon=None` keeps them on the tl.dot kernel
GLUON_TRITON = ("3.6.",)
# registers a thread of the seesaw kernel's second warpgroup (setmaxnreg); the first gets the rest of the 64K
SEESAW_WORKER_REGS = 256


def _gluon_fits(q: torch.Tensor, kv_buffer: torch.Tensor, shape: tuple[int | None, ...],
                fp8_dtype: torch.dtype | None) -> bool:
    """shape: (block_h, block_n, warps, R, DR) of the launch."""
    return (q.device.type == "cuda" and not torch.version.hip and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16)
            and (kv_buffer.dtype == q.dtype if fp8_dtype is None else kv_buffer.dtype == torch.uint8)
            and shape == (64, 64, 8, 512, 64)
            and kv_buffer.stride(0) % 8 == 0 and kv_buffer.data_ptr() % 16 == 0)  # 16-byte cp.async chunks


def use_gluon(q: torch.Tensor, kv_buffer: torch.Tensor, r: int, dr: int, config: MLADecodeConfig,
              fp8_dtype: torch.dtype | None) -> bool:
    """Whether stage 1 runs the Gluon kernel (`MLADecodeConfig.gluon`; config resolved). Measured on the H200
    (session 18, benchmarks/results/s18/): B64 H128 ctx 4096 bf16 0.303 -> 0.195 ms, FlashInfer MLA 0.143; fp8
    latents 0.440 -> 0.339 ms; e4m3 moved into bf16 by bits (session 22) 0.297 ms."""
    if config.gluon is False:
        return False
    shape = (config.block_h, config.block_n, config.num_warps, r, dr)
    fits = _gluon_fits(q, kv_buffer, shape, fp8_dtype)
    if config.gluon and not fits:
        raise ValueError("the Gluon MLA decode kernel takes SM90 GPUs, bf16/fp16 queries over latents of 512 + 64 "
                         "(the query's dtype or fp8) in 16-byte aligned rows and the 64-head launch (block_h 64, "
                         f"block_n 64, 8 warps); got {q.device}, {q.dtype}, KV {kv_buffer.dtype}, "
                         f"fp8 {fp8_dtype}, (block_h, block_n, warps, R, DR) = {shape}: leave MLADecodeConfig.gluon "
                         "unset")
    return fits and (bool(config.gluon) or triton.__version__.startswith(GLUON_TRITON))


def _gluon_stage1(q: torch.Tensor, q_pe: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
                  qk_scale: float, v_scale: float, max_splits: int, min_chunk: int,
                  fp8_dtype: torch.dtype | None, seesaw: bool = False) -> None:
    """Stage 1 through `mla_decode_gluon`, or `mla_decode_seesaw` (16-bit latents): same outputs as
    `_mla_decode_stage1`; `use_gluon` said it fits. Both Gluon kernels take the same arguments."""
    bs, h, r = q.shape
    fmt = kv_format(fp8_dtype)
    if bits_k_applies(fmt, q.dtype):  # e4m3 latents moved into bfloat16 by bits (FMT 3; seesaw takes 16-bit only):
        fmt = 3  # the kernel lifts q, so the scores owe BITS_K_SCORE_SCALE; its outputs owe all of BITS_K_VALUE_SCALE
        qk_scale, v_scale = qk_scale * BITS_K_SCORE_SCALE.value, v_scale * BITS_K_VALUE_SCALE
    args = (q, q_pe, kv_buffer, kv_indptr, kv_indices, mid_o, mid_lse, out, qk_scale, v_scale, max_splits, min_chunk,
            q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), kv_buffer.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1))
    consts = dict(H=h, BLOCK_H=64, R=r, DR=q_pe.shape[-1], BLOCK_N=64, SINGLE=max_splits == 1)
    grid = (triton.cdiv(h, 64), bs, max_splits)
    if seesaw:
        from sglx.attention.kernels.mla_decode_seesaw import _mla_decode_stage1_seesaw

        _mla_decode_stage1_seesaw[grid](*args, **consts, WORKER_REGS=SEESAW_WORKER_REGS, num_warps=4)
    else:
        from sglx.attention.kernels.mla_decode_gluon import _mla_decode_stage1_gluon

        _mla_decode_stage1_gluon[grid](*args, **consts, FMT=fmt, num_warps=8)


def mla_decode_attention(
    q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    mid_o: torch.Tensor, mid_lse: torch.Tensor, scaling: float, kv_lora_rank: int, *, kv_scale: float = 1.0,
    fp8_dtype: torch.dtype | None = None, config: MLADecodeConfig = MLADecodeConfig(), interpret: bool = False,
    q_pe: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [bs, H, R + DR] (absorbed query), kv_buffer [slots, 1, R + DR] (one layer's latents, or their fp8
    bits) -> out [bs, H, R], the attention output in latent space (apply W_UV after). With `q_pe` [bs, H, DR]
    given, q is only the latent part [bs, H, R]: the two halves are read where they lie (no concatenation).

    mid_o [bs, H, max_splits, R] and mid_lse [bs, H, max_splits] (float32) are scratch whose split
    dimension sets `max_splits`."""
    r = kv_lora_rank
    if q_pe is None:
        q, q_pe = q[..., :r], q[..., r:]
    bs, h, _ = q.shape
    dr = q_pe.shape[-1]
    dim = r + dr
    if q.shape[-1] != r or q_pe.shape[:2] != q.shape[:2]:
        raise ValueError(f"latent query {tuple(q.shape)} and rope query {tuple(q_pe.shape)} do not fit "
                         f"kv_lora_rank {r}")
    if bs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if kv_buffer.stride(-1) != 1 or kv_buffer.shape[-1] != dim:
        raise ValueError(f"latent buffer {tuple(kv_buffer.shape)} does not match the query width {dim}")
    max_splits = mid_lse.shape[-1]
    config = resolve_config(config, h, fp8_dtype is not None, q.device, interpret)
    block_n, num_warps, num_stages = config.block_n, config.num_warps, config.num_stages
    block_h = _block_h(h, config)
    min_chunk = split_chunk(config, bs, h)
    single = max_splits == 1
    gluon = use_gluon(q, kv_buffer, r, dr, config, fp8_dtype)
    if config.seesaw and (fp8_dtype is not None or not gluon):
        raise ValueError("MLADecodeConfig.seesaw runs on the Gluon route with 16-bit latents (SM90, the 64-head "
                         f"launch); got {q.device}, KV {kv_buffer.dtype}, fp8 {fp8_dtype}: leave seesaw unset")
    if gluon:
        _gluon_stage1(q, q_pe, kv_buffer, kv_indptr, kv_indices, mid_o, mid_lse, out, scaling * kv_scale * LOG2E,
                      float(kv_scale), max_splits, min_chunk, fp8_dtype, seesaw=bool(config.seesaw))
    else:
        _mla_decode_stage1[(triton.cdiv(h, block_h), bs, max_splits)](
            q, q_pe, kv_buffer, kv_indptr, kv_indices, mid_o, mid_lse, out,
            scaling * kv_scale * LOG2E, float(kv_scale), max_splits, min_chunk,
            q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), kv_buffer.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            H=h, BLOCK_H=block_h, R=r, DR=dr, BLOCK_R=padded_dim(r), BLOCK_DR=padded_dim(dr), BLOCK_N=block_n,
            FMT=kv_format(fp8_dtype), IEEE=q.dtype == torch.float32, SINGLE=single, num_warps=num_warps,
            num_stages=num_stages,
        )
    if single:
        return out
    block_s = triton.next_power_of_2(max_splits)
    block_hm, block_dv = merge_launch(bs, h, r, block_s, 1 if interpret else num_sms(q.device))
    _mla_merge_kernel[(bs, triton.cdiv(h, block_hm), triton.cdiv(r, block_dv))](
        mid_o, mid_lse, out, kv_indptr, max_splits, min_chunk,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        H=h, R=r, BLOCK_HM=block_hm, BLOCK_DV=block_dv, BLOCK_S=block_s, BLOCK_N=block_n,
        num_warps=4 if not interpret else 1,
    )
    return out
