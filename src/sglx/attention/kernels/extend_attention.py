"""Paged extend (prefill) attention: new queries attend to the cached prefix and, causally, to each other.

Every key, the prefix's and this step's, is read from the KV pool through `kv_indices` (the backend
stores this step's K/V first), exactly like the reference backend, so fp8 KV means the same numbers
in both. One program owns BLOCK_M queries of one head of one request; its key range is cut into a
masked low edge (sliding window), an unmasked middle and a masked diagonal, so only the edge tiles
pay for masks. Query blocks run heaviest (last) first, within each (request, head) or, in sections
(`ExtendConfig.section`), across a few of them. fp8 per-token scales (`[rows, Hkv]` tensors) are
loaded with each tile's slots and multiply scores and probabilities in registers, as in decode.
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
    fp8_bits_to_value,
    has_tma,
    kv_format,
    offsets_fit_int32,
    online_softmax_step,
    padded_dim,
    pv_step,
    slot_offsets,
    tma_rows_descriptor,
    tma_rows_ok,
)


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters; `None` fields are chosen from the head dim and the device."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # this step's K/V tiles (the EXT path) through TMA descriptors (CUDA SM90+, head dims 64/128/256, 16-byte
    # aligned rows, else plain loads); None: the device's default (on for SM90+)
    tma: bool | None = None
    # Triton's warp specialization of the key loops (`tl.range(warp_specialize=True)`: producer warps issue the
    # loads); off unless asked (measured by benchmarks/sweep_extend_prefill.py)
    warp_specialize: bool = False
    # program order: 0 = each (request, head)'s query blocks heaviest first, one pair after another (grid
    # [query blocks, batch, heads]); n > 0 = n pairs at a time, heaviest first across all n (longest work first
    # while their K/V stay in L2); None: the device's default (`_section`)
    section: int | None = None
    # the unmasked pool loop reads each tile's slot ids one tile ahead, into registers. Without it Triton's
    # pipeliner turns the id loads into async copies of their own, and the `async_wait num=0` they force at the
    # loop head waits for the K/V copies just issued: the gathered tiles never overlap the previous tile's work
    # (TTGIR of the 3-stage launch, session 19); with it the loop waits with 2 copies in flight. None: on where
    # most keys come from the pool (the tile-shape rule's "not ext_heavy"; an fp8 pool always). H200, session 19,
    # B4 H32 D128 page 16, `sglx bench attention --phase prefill`, old/new alternated (benchmarks/results/s19/
    # prefill_slot_prefetch/): 512 new on a 4096 prefix 0.4425 / 0.4465 -> 0.4007 / 0.4052 ms (FlashInfer paged
    # 0.304-0.307), fp8 pool 0.623 / 0.621 -> 0.530 / 0.535, fp8 causal 4096 2.302 / 2.287 -> 2.055 / 2.039. Forced
    # on for bf16 causal 4096 with no prefix it was 2-5% slower (1.249 / 1.221 -> 1.279 / 1.283 ms; ptxas spills
    # next to the hot TMA loops), so there it stays off
    prefetch_slots: bool | None = None
    # e4m3 pool, bfloat16 queries: K's bits are moved into bfloat16 by integer operations
    # (`e4m3_bits_to_bf16_scaled`) instead of the hardware conversion (F2FP then F2F, the SM's conversion unit,
    # per pair of values). None: on for CUDA devices (never under the interpreter, which runs no inline PTX).
    # H200, session 21, B4 H32 D128 page 16, alternated: causal 4096 2.000 / 2.000 -> 1.983 / 1.969 ms, 512 new on a
    # 4096 prefix 0.531 / 0.531 -> 0.514 / 0.513 (decode gained 6% from the same move)
    fp8_bits_k: bool | None = None
    # head dims of 128 plus a power of two (MLA's expanded 192 = 128 + 64) as two tiles and two products (`head_split`)
    # instead of one padded to the next power of two (256: a third of the QK^T work on zeros). None: on (not with
    # TMA or bit-moved fp8 K, which take power-of-two heads)
    split_head: bool | None = None


@triton.jit
def _extend_tiles(
    acc, l_i, m_i, q, q_pe, q_pos, lo, hi, kv_start, kv_len, K_Buf, V_Buf, Kv_Indices, kv_head,
    qk_scale, logit_cap, win, stride_kt, stride_kh, stride_vt, stride_vh,
    offs_d, offs_pe, offs_dv, d_mask, dv_mask, K_Ext, V_Ext, ext_row0, stride_ekt, stride_ekh, stride_evt,
    stride_evh, K_Scale, V_Scale, stride_ks, stride_vs, ext_col_k, ext_col_v,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FMT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    FROM_EXT: tl.constexpr, SLOT_SCALES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
    PREFETCH: tl.constexpr, SLOT64: tl.constexpr, DPE: tl.constexpr,
):
    """Online-softmax accumulation over keys [lo, hi); MASKED applies causal/window/length masks.

    FROM_EXT reads the keys from this step's contiguous K/V rows (ext_row0 + key position) instead of
    gathering pool slots: no index load sits in front of the tile loads, so they pipeline freely. With TMA
    (FROM_EXT only) K_Ext/V_Ext are [T, Hkv * D] descriptors: rows past the tensor read as zeros, rows of the
    next request are finite and hidden by the causal/length mask of the MASKED tiles. Pool tiles load K as
    [keys, D] rows like V and transpose in shared memory, so both gathers use one layout of the slot ids (two
    replicated layouts cost 8 id loads and 12 spill instructions a tile); SLOT64: the pool's offsets need 64 bits.
    DPE > 0: the head dim is BLOCK_D + DPE (MLA's expanded 128 + 64), the last DPE columns a second tile and a second
    product (q_pe, offs_pe) instead of padding the whole head to the next power of two (no TMA, no bit-moved fp8 K).
    """
    if PREFETCH and not FROM_EXT and not MASKED:  # slot ids a tile ahead, in registers (ExtendConfig.prefetch_slots)
        ahead = lo + tl.arange(0, BLOCK_N)
        next_slots = tl.load(Kv_Indices + kv_start + ahead, mask=(ahead < hi) & (ahead < kv_len), other=0)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start + tl.arange(0, BLOCK_N)
        if FROM_EXT and TMA:
            k = tl.trans(K_Ext.load([ext_row0 + start, ext_col_k]))
            v = V_Ext.load([ext_row0 + start, ext_col_v])
        elif FROM_EXT:
            rows = (ext_row0 + offs_n).to(tl.int64)
            n_mask = offs_n < kv_len
            k = tl.load(K_Ext + rows[None, :] * stride_ekt + kv_head * stride_ekh + offs_d[:, None],
                        mask=n_mask[None, :] & d_mask[:, None], other=0.0)
            if DPE > 0:
                k_pe = tl.load(K_Ext + rows[None, :] * stride_ekt + kv_head * stride_ekh + offs_pe[:, None],
                               mask=n_mask[None, :], other=0.0)
            v = tl.load(V_Ext + rows[:, None] * stride_evt + kv_head * stride_evh + offs_dv[None, :],
                        mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        elif MASKED:
            n_mask = offs_n < kv_len
            slots = slot_offsets(tl.load(Kv_Indices + kv_start + offs_n, mask=n_mask, other=0), SLOT64)
            k = tl.trans(tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                                 mask=n_mask[:, None] & d_mask[None, :], other=0.0))
            if DPE > 0:
                k_pe = tl.trans(tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_pe[None, :],
                                        mask=n_mask[:, None], other=0.0))
            v = tl.load(V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                        mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
        else:
            if PREFETCH:
                slots = slot_offsets(next_slots, SLOT64)
                ahead = offs_n + BLOCK_N
                next_slots = tl.load(Kv_Indices + kv_start + ahead, mask=(ahead < hi) & (ahead < kv_len), other=0)
            else:
                slots = slot_offsets(tl.load(Kv_Indices + kv_start + offs_n), SLOT64)
            k = tl.trans(tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                                 mask=d_mask[None, :], other=0.0))
            if DPE > 0:
                k_pe = tl.trans(tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_pe[None, :]))
            v = tl.load(V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                        mask=dv_mask[None, :], other=0.0)
        if FMT == 3:  # e4m3 K as bf16 at 2**-120 of its value (q was scaled by 2**64; the scores take 2**56)
            k = e4m3_bits_to_bf16_scaled(k)
            v = fp8_bits_to_value(v, 1).to(q.dtype)
        else:
            k = fp8_bits_to_value(k, FMT).to(q.dtype)
            v = fp8_bits_to_value(v, FMT).to(q.dtype)
            if DPE > 0:
                k_pe = fp8_bits_to_value(k_pe, FMT).to(q.dtype)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < kv_len)
        visible = visible & (offs_n[None, :] > q_pos[:, None] - win)  # unused (removed) when not MASKED
        qk = dot(q, k, IEEE)
        if DPE > 0:
            qk += dot(q_pe, k_pe, IEEE)
        if FMT == 3:
            qk = bits_k_scores(qk)
        if SLOT_SCALES and not FROM_EXT:  # slots of masked tiles were loaded as 0 (the padding slot)
            qk = qk * tl.load(K_Scale + slots * stride_ks + kv_head)[None, :]
        p, alpha, m_new, l_i = online_softmax_step(qk, visible, m_i, l_i, qk_scale, logit_cap, MASKED, SOFTCAP)
        v_scale_n = alpha  # unused without per-slot scales
        if SLOT_SCALES and not FROM_EXT:
            v_scale_n = tl.load(V_Scale + slots * stride_vs + kv_head)
        acc = pv_step(acc, alpha, p, v, v_scale_n, SLOT_SCALES and not FROM_EXT, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    Q, Out, K_Buf, V_Buf, Qo_Indptr, Kv_Indptr, Kv_Indices, K_Ext, V_Ext, K_Scale, V_Scale,
    qk_scale, logit_cap, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ekt, stride_ekh, stride_evt, stride_evh, stride_ks, stride_vs, EXT: tl.constexpr, TMA: tl.constexpr,
    WS: tl.constexpr, SECTION: tl.constexpr, M_BLOCKS, NUM_BH, HQ,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    SLOT_SCALES: tl.constexpr, PREFETCH: tl.constexpr, SLOT64: tl.constexpr, DPE: tl.constexpr,
):
    if SECTION > 0:  # one axis: SECTION (request, head) pairs at a time, heaviest query blocks first across them
        pid = tl.program_id(0)
        per_section = SECTION * M_BLOCKS
        first = (pid // per_section) * SECTION
        size = tl.minimum(SECTION, NUM_BH - first)
        r = pid % per_section
        m_block = M_BLOCKS - 1 - r // size
        bh = first + r % size
        b = bh // HQ
        head = bh % HQ
    else:
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        b = tl.program_id(1)
        head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(Qo_Indptr + b)
    ext_len = tl.load(Qo_Indptr + b + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 < ext_len:
        kv_start = tl.load(Kv_Indptr + b)
        kv_len = tl.load(Kv_Indptr + b + 1) - kv_start
        prefix = kv_len - ext_len

        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < ext_len
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_mask = offs_d < D
        dv_mask = offs_dv < DV
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if DPE > 0:  # the head's last DPE columns (MLA's rope part): a tile of their own
            offs_pe = BLOCK_D + tl.arange(0, DPE)
            q_pe = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_pe[None, :],
                           mask=m_mask[:, None], other=0.0)
        else:  # unused
            offs_pe = offs_d
            q_pe = q
        if FMT == 3:  # K tiles arrive at 2**-120 of their values (e4m3_bits_to_bf16_scaled): exact powers of two
            q = bits_k_query(q)

        # Keys every valid query of the block sees: [full_lo, q_first]; partially seen below and above.
        q_first = prefix + m0
        q_last = prefix + tl.minimum(m0 + BLOCK_M, ext_len) - 1
        win = tl.where(window > 0, window, 1 << 30)  # no window: one wider than any context
        k_lo = tl.maximum(q_first - win + 1, 0)
        full_lo = tl.minimum(tl.cdiv(tl.maximum(q_last - win + 1, 0), BLOCK_N) * BLOCK_N, q_last + 1)
        full_hi = tl.maximum(full_lo, ((q_first + 1) // BLOCK_N) * BLOCK_N)
        edge_lo = (k_lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        ext_row0 = q_start - prefix  # row of key position p in K_Ext/V_Ext: ext_row0 + p
        # tiles wholly inside this step's tokens may come from K_Ext/V_Ext; the one straddling the
        # prefix boundary, and every prefix tile, come from the pool
        if EXT:  # noqa: SIM108 - constexpr branch, resolved at compile time
            ext_lo = tl.cdiv(prefix, BLOCK_N) * BLOCK_N
        else:
            ext_lo = kv_len + BLOCK_N  # past every key: the pool serves them all
        ranges_args = (K_Buf, V_Buf, Kv_Indices, kv_head, qk_scale, logit_cap, win, stride_kt, stride_kh,
                       stride_vt, stride_vh, offs_d, offs_pe, offs_dv, d_mask, dv_mask, K_Ext, V_Ext, ext_row0,
                       stride_ekt, stride_ekh, stride_evt, stride_evh, K_Scale, V_Scale, stride_ks, stride_vs,
                       kv_head * D, kv_head * DV)
        acc, l_i, m_i = _extend_tiles(acc, l_i, m_i, q, q_pe, q_pos, edge_lo, full_lo, kv_start, kv_len,
                                      *ranges_args, BLOCK_N, True, FMT, SOFTCAP, IEEE, False, SLOT_SCALES, TMA, WS,
                                      PREFETCH, SLOT64, DPE)
        mid_split = tl.minimum(tl.maximum(ext_lo, full_lo), full_hi)
        acc, l_i, m_i = _extend_tiles(acc, l_i, m_i, q, q_pe, q_pos, full_lo, mid_split, kv_start, kv_len,
                                      *ranges_args, BLOCK_N, False, FMT, SOFTCAP, IEEE, False, SLOT_SCALES, TMA, WS,
                                      PREFETCH, SLOT64, DPE)
        if EXT:
            acc, l_i, m_i = _extend_tiles(acc, l_i, m_i, q, q_pe, q_pos, mid_split, full_hi, kv_start, kv_len,
                                          *ranges_args, BLOCK_N, False, FMT, SOFTCAP, IEEE, True, SLOT_SCALES, TMA, WS,
                                          PREFETCH, SLOT64, DPE)
        diag_split = tl.minimum(tl.maximum(ext_lo, full_hi), q_last + 1)
        acc, l_i, m_i = _extend_tiles(acc, l_i, m_i, q, q_pe, q_pos, full_hi, diag_split, kv_start, kv_len,
                                      *ranges_args, BLOCK_N, True, FMT, SOFTCAP, IEEE, False, SLOT_SCALES, TMA, WS,
                                      PREFETCH, SLOT64, DPE)
        if EXT:
            acc, l_i, m_i = _extend_tiles(acc, l_i, m_i, q, q_pe, q_pos, diag_split, q_last + 1, kv_start, kv_len,
                                          *ranges_args, BLOCK_N, True, FMT, SOFTCAP, IEEE, True, SLOT_SCALES, TMA, WS,
                                          PREFETCH, SLOT64, DPE)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # rows past ext_len saw nothing
        o_rows = (q_start + offs_m).to(tl.int64)
        tl.store(Out + o_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :], out.to(Out.dtype.element_ty),
                 mask=m_mask[:, None] & dv_mask[None, :])


def _kv_code(config: ExtendConfig, fp8_dtype: torch.dtype | None, q: torch.Tensor, interpret: bool) -> int:
    """The kernel's FMT: kv_format's 0 (native) / 1 (e4m3) / 2 (e5m2), or 3 for e4m3 with K by integer bit moves
    (bfloat16 queries only: the moved bits are bfloat16)."""
    fmt = kv_format(fp8_dtype)
    wanted = config.fp8_bits_k
    if wanted is None:
        wanted = not interpret and q.device.type == "cuda" and not torch.version.hip
    return 3 if wanted and bits_k_applies(fmt, q.dtype) else fmt


def head_split(dim: int) -> tuple[int, int]:
    """(BLOCK_D, DPE): a head dim of 128 plus a power of two from 16 to 64 (MLA's expanded 192) runs as a 128-wide tile
    and a DPE-wide one; any other as one tile padded to the next power of two (DPE 0; 256 is not padded)."""
    rest = dim - 128
    if 16 <= rest < 128 and rest & (rest - 1) == 0:
        return 128, rest
    return padded_dim(dim), 0


LONG_SPLIT_KEYS = 2048  # mean keys a request from which split heads take the large tile (`_launch`)


def _launch(config: ExtendConfig, head_dim: int, device: torch.device, interpret: bool, ext_heavy: bool,
            tma: bool = False, split_long: bool = False) -> tuple[int, int, int, int]:
    """split_long: split heads (`head_split`) over requests of LONG_SPLIT_KEYS keys or more on average. H200, session
    31 (benchmarks/results/s31/call10, one MLA layer's extend at 192 / 128, split heads): 128 x 64, 8 warps, 3 stages
    against 64 x 32, 4 warps, 2 stages: DeepSeek-V2-Lite 4 x 4,096 new 1.71 / 2.16 ms, 4,096 cached + 512 new 0.74 /
    1.11, DeepSeek-V3 4,096 + 512 1.68 / 1.98; on 512-key requests slower (V2-Lite 1 x 512 0.79 / 0.65, V3 1.00 /
    0.72), where the small tile stays."""
    if interpret:
        return config.block_m or 16, config.block_n or 16, 1, 1
    if torch.version.hip:  # 64 KB LDS: small tiles, no multi-stage buffering (not measured yet)
        block_m, block_n, warps, stages = 64, 64, 4, 1
    elif head_dim > 128:
        block_m, block_n, warps, stages = (128, 64, 8, 3) if split_long else (64, 32, 4, 2)
    elif torch.cuda.get_device_capability(device)[0] >= 9:
        # H100 sweeps, B4 H32 D128. Session 12 (benchmarks/results/sweep_extend_prefill_h100_s12.json, cuDNN in
        # the same run): this step's K/V through TMA, 128x128, 8 warps, 3 stages: causal 4096 435 TFLOP/s = 0.826x
        # cuDNN (MHA; GQA-8 0.828x) against plain loads' 128x64 389 (0.740x) and 128x128 360; 512 new on 4096
        # cached 332 TFLOP/s = 1.13x cuDNN's masked call. Earlier, without TMA: 128x64 won where keys come mostly
        # from this step's rows, 128x128 where they are mostly gathered from the pool (plain loads keep that rule).
        block_m, block_n, warps, stages = (128, 64, 8, 3) if ext_heavy and not tma else (128, 128, 8, 3)
    else:  # ~100-164 KB shared memory: 128x64 tiles fit with 3 stages
        block_m, block_n, warps, stages = 128, 64, 4, 3
    return (config.block_m or block_m, config.block_n or block_n, config.num_warps or warps,
            config.num_stages or stages)


def _section(config: ExtendConfig, device: torch.device, interpret: bool, group: int, ext_heavy: bool) -> int:
    """Program order (`ExtendConfig.section`): the config's, else 8 (request, head) pairs at a time on SM90+ for GQA
    prefill that reads mostly this step's rows. Session 16's two H100 runs (sweep_extend_{fma_,}sections_h100_s16.json,
    x cuDNN's causal call in the same run, alternated): GQA-8 causal 4096 B4 0.798-0.826 (mean 0.811) -> 0.808-0.849
    (0.830), 8192 B1 0.864-0.867 -> 0.891-0.909, 2048 B2 0.690-0.693 -> 0.736-0.739; MHA within the noise (0.771-0.824
    -> 0.792-0.823) and 512 new on a 4096 prefix 1-1.5% slower, so both keep 0."""
    if config.section is not None:
        return config.section
    if interpret or torch.version.hip or not has_tma(device):
        return 0
    return 8 if group > 1 and ext_heavy else 0


def _tma_wanted(config: ExtendConfig, device: torch.device, interpret: bool) -> bool:
    """Whether this launch loads this step's K/V rows by TMA: the config's choice, else on for SM90+ GPUs (session
    12's H100 sweep: +11-21% on causal prefill; see `_launch`)."""
    if config.tma is False:
        return False
    if interpret:
        return bool(config.tma)  # the interpreter emulates descriptors: the CPU tests cover the indexing
    return has_tma(device)


def extend_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_extend_len: int,
    scaling: float, *, sliding_window: int | None = None, logit_cap: float = 0.0,
    k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, fp8_dtype: torch.dtype | None = None,
    config: ExtendConfig = ExtendConfig(), interpret: bool = False,
    k_ext: torch.Tensor | None = None, v_ext: torch.Tensor | None = None, prefix_tokens: int = 0,
) -> torch.Tensor:
    """q [T, Hq, D] (request i's rows qo_indptr[i]:qo_indptr[i+1]) -> out [T, Hq, Dv]; request i's keys are
    kv_indices[kv_indptr[i]:kv_indptr[i+1]], its new tokens being the last ones (already stored).

    k_ext/v_ext [T, Hkv, D] (optional): this step's K/V rows, aligned with q. With a native-dtype pool they
    hold exactly what was stored, and the new tokens' tiles are read from them instead of gathered
    from the pool. An fp8 pool ignores them, so both paths see the same quantized keys. prefix_tokens (the
    batch's cached keys, known on the host) only picks the tile shape (with T, the mean keys a request).
    k_scale/v_scale: one float per layer, or float32 `[rows, Hkv]` per-slot scales (q then already in the pool's
    rotated key basis)."""
    num_tokens, hq, dim = q.shape
    bs = qo_indptr.shape[0] - 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if num_tokens == 0 or bs == 0 or max_extend_len == 0:
        return out
    hkv = k_buffer.shape[1]
    dim_v = v_buffer.shape[-1]
    ext = k_ext is not None and v_ext is not None and fp8_dtype is None
    if ext:
        k_ext = k_ext.reshape(num_tokens, hkv, -1)
        v_ext = v_ext.reshape(num_tokens, hkv, -1)
    tma = ext and _tma_wanted(config, q.device, interpret) and all(tma_rows_ok(t) for t in (k_ext, v_ext))
    ext_heavy = ext and prefix_tokens <= num_tokens
    fmt = _kv_code(config, fp8_dtype, q, interpret)
    block_d, dpe = head_split(dim)
    if dpe and (config.split_head is False or tma or fmt == 3):
        block_d, dpe = padded_dim(dim), 0
    # the large tile was measured (and fits shared memory) with values of at most 128, as MLA's expanded ones
    split_long = dpe > 0 and dim_v <= 128 and prefix_tokens + num_tokens >= LONG_SPLIT_KEYS * bs
    block_m, block_n, num_warps, num_stages = _launch(config, dim, q.device, interpret, ext_heavy, tma, split_long)
    prefetch = not ext_heavy if config.prefetch_slots is None else config.prefetch_slots
    softcap = logit_cap > 0
    slot_scales = isinstance(k_scale, torch.Tensor)
    if slot_scales:
        k_scales, v_scales = k_scale, v_scale
        k_scale = v_scale = 1.0
    else:
        k_scales = v_scales = qo_indptr  # unused
    qk_scale = scaling * k_scale * (1.0 if softcap else LOG2E)
    m_blocks = triton.cdiv(max_extend_len, block_m)
    section = min(_section(config, q.device, interpret, hq // hkv, ext_heavy), bs * hq)
    grid = (m_blocks * bs * hq, 1, 1) if section > 0 else (m_blocks, bs, hq)
    if not ext:
        k_ext, v_ext = k_buffer, v_buffer  # unused by the kernel
    k_ext_arg, v_ext_arg = ((tma_rows_descriptor(k_ext, block_n), tma_rows_descriptor(v_ext, block_n)) if tma
                            else (k_ext, v_ext))
    _extend_kernel[grid](
        q, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, k_ext_arg, v_ext_arg, k_scales, v_scales,
        qk_scale, float(logit_cap), float(v_scale), int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_ext.stride(0), k_ext.stride(1), v_ext.stride(0), v_ext.stride(1), k_scales.stride(0), v_scales.stride(0),
        EXT=ext, TMA=tma, WS=config.warp_specialize, SECTION=section, M_BLOCKS=m_blocks, NUM_BH=bs * hq, HQ=hq,
        GROUP=hq // hkv, D=dim, DV=dim_v, BLOCK_D=block_d, BLOCK_DV=padded_dim(dim_v),
        BLOCK_M=block_m, BLOCK_N=block_n, FMT=fmt, SOFTCAP=softcap,
        IEEE=q.dtype == torch.float32, SLOT_SCALES=slot_scales, PREFETCH=prefetch,
        SLOT64=not offsets_fit_int32(k_buffer, v_buffer), DPE=dpe,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
