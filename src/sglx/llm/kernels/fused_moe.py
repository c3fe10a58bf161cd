"""Fused MoE experts in Triton: tokens sorted by expert on the device, then two grouped GEMMs.

Why: a decode step's MoE layer reads only the experts its tokens chose, so it is bandwidth-bound, and at
small batches it is launch-bound too. Here a whole layer is four launches (six for many pairs) with no host
sync (CUDA graphs capture it): (1) the (token, choice) pairs sorted by expert into blocks of BLOCK_M rows
(`moe_align`: each block belongs to one expert, padded rows masked), (2) gate/up GEMM with SiLU(gate) * up fused,
one program per (block, column tile), each reading only its expert's weight tile, (3) down GEMM times
the routing weight, written per pair in float32, (4) the sum over a token's top-k choices, cast to the
model dtype, plus (optionally) the shared experts' output. The sort
is stable, so a token's rows are in pair order; the sum runs in float32 (HF adds in the model dtype).
Like SGLang's fused_moe (moe_align_block_size + fused_moe_kernel), written here for sglx's layouts:
w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I].

`MoETiles(persistent=True)` runs (2) and (3) as one launch of one program per SM that takes tiles from a queue,
a block's down tiles waiting on its gate/up tiles (one launch, ramp and tail less a layer). It is tested (bitwise
equal to the two launches, interpreted and on the H100; compiled for sm_90a) but not the default: session 16 found it
faster in isolation and no faster in the V2-Lite decode step (`default_tiles`; benchmarks/sweep_fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import dot, num_sms
from sglx.llm.kernels.moe_align import moe_align
from sglx.llm.kernels.rounding import round_to


@triton.jit
def _moe_tile(A, W, C, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, Shared_W, pid_m, pid_n,
              N, K, up_offset, a_div, num_routed, s_up_offset,
              stride_am, stride_we, stride_wn, stride_wk, stride_cm, s_stride_we, s_stride_wn,
              FUSE_SILU: tl.constexpr, ROUTED: tl.constexpr, IEEE: tl.constexpr, HAS_SHARED: tl.constexpr,
              A_CG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (block, column tile): C[pair, n] = A[pair // a_div] . W[e, n] for the block's rows; FUSE_SILU:
    silu(gate) * up with the up rows `up_offset` rows further in W; ROUTED: times the pair's routing weight.
    HAS_SHARED: experts from `num_routed` on are slices of the shared experts' weight Shared_W (own expert/row
    strides and up offset). A_CG: A is read past L1 (rows another program of this launch just wrote)."""
    expert = tl.load(Block_Expert + pid_m)
    if expert >= 0:
        if HAS_SHARED:  # noqa: SIM102 - a compile-time branch around a runtime one
            if expert >= num_routed:
                W = Shared_W
                expert = expert - num_routed
                stride_we = s_stride_we
                stride_wn = s_stride_wn
                up_offset = s_up_offset
        n_rows = tl.load(Block_Rows + pid_m)
        offs_m = tl.arange(0, BLOCK_M)
        row_mask = offs_m < n_rows
        pairs = tl.load(Sorted_Ids + pid_m * BLOCK_M + offs_m, mask=row_mask, other=0)
        a_rows = (pairs // a_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
        w_ptrs = (W + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            if A_CG:
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
            else:
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += dot(a, w, IEEE)
            if FUSE_SILU:
                w_up = tl.load(w_ptrs + up_offset * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up += dot(a, w_up, IEEE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if FUSE_SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if ROUTED:
            acc = acc * tl.load(Routed_W + pairs, mask=row_mask, other=0.0)[:, None]
        c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_gemm_kernel(A, W, C, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, Shared_W,
                     N, K, up_offset, a_div, num_routed, s_up_offset,
                     stride_am, stride_we, stride_wn, stride_wk, stride_cm, s_stride_we, s_stride_wn,
                     FUSE_SILU: tl.constexpr, ROUTED: tl.constexpr, IEEE: tl.constexpr, HAS_SHARED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One GEMM of the layer, a program per (block, column tile) (`_moe_tile`)."""
    _moe_tile(A, W, C, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, Shared_W, tl.program_id(0), tl.program_id(1),
              N, K, up_offset, a_div, num_routed, s_up_offset,
              stride_am, stride_we, stride_wn, stride_wk, stride_cm, s_stride_we, s_stride_wn,
              FUSE_SILU, ROUTED, IEEE, HAS_SHARED, False, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _moe_persistent_kernel(X, W13, W2, Inter, Y, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, S13, S2, Work,
                           hidden, inter_size, top_k, num_routed, s13_up_offset, num_blocks,
                           stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_im, s13_stride_e, s13_stride_n,
                           stride_w2e, stride_w2n, stride_w2k, stride_ym, s2_stride_e, s2_stride_n,
                           IEEE: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
                           UP_N: tl.constexpr, UP_K: tl.constexpr, DOWN_N: tl.constexpr, DOWN_K: tl.constexpr,
                           BLOCK_B: tl.constexpr):
    """Both GEMMs in one launch: programs take tiles from one queue (Work[0]), every gate/up tile before any down
    tile; a down tile of block m waits until the block's gate/up tiles are done (Work[2 + m], released after
    their stores). A program only waits once every gate/up tile is held by a running program, so no wait can
    deadlock, whatever share of the grid is resident. The last program to leave (Work[1]) zeroes Work for the
    next launch (CUDA graph replays)."""
    up_cols = tl.cdiv(inter_size, UP_N)
    down_cols = tl.cdiv(hidden, DOWN_N)
    n_up = num_blocks * up_cols
    total = n_up + num_blocks * down_cols
    idx = tl.atomic_add(Work, 1, sem="relaxed", scope="gpu")
    while idx < total:
        if idx < n_up:
            m = idx // up_cols
            _moe_tile(X, W13, Inter, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, S13, m, idx % up_cols,
                      inter_size, hidden, inter_size, top_k, num_routed, s13_up_offset,
                      stride_xm, stride_w13e, stride_w13n, stride_w13k, stride_im, s13_stride_e, s13_stride_n,
                      True, False, IEEE, HAS_SHARED, False, BLOCK_M, UP_N, UP_K)
            tl.debug_barrier()  # every thread's stores of the tile before the (single-thread) release
            tl.atomic_add(Work + 2 + m, 1, sem="release", scope="gpu")
        else:
            m = (idx - n_up) // down_cols
            if tl.load(Block_Expert + m) >= 0:  # unused blocks write nothing and wait for nothing
                done = tl.atomic_add(Work + 2 + m, 0, sem="acquire", scope="gpu")
                while done < up_cols:
                    done = tl.atomic_add(Work + 2 + m, 0, sem="acquire", scope="gpu")
            _moe_tile(Inter, W2, Y, Sorted_Ids, Block_Expert, Block_Rows, Routed_W, S2, m, (idx - n_up) % down_cols,
                      hidden, inter_size, inter_size, 1, num_routed, s13_up_offset,  # (up offsets unused here)
                      stride_im, stride_w2e, stride_w2n, stride_w2k, stride_ym, s2_stride_e, s2_stride_n,
                      False, True, IEEE, HAS_SHARED, True, BLOCK_M, DOWN_N, DOWN_K)
        idx = tl.atomic_add(Work, 1, sem="relaxed", scope="gpu")
    if tl.atomic_add(Work + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        for b0 in range(0, num_blocks + 2, BLOCK_B):  # every other program is past its last queue read
            offs = b0 + tl.arange(0, BLOCK_B)
            tl.store(Work + offs, tl.zeros([BLOCK_B], dtype=tl.int32), mask=offs < num_blocks + 2)


@triton.jit
def _moe_sum_kernel(Y, Add, Out, top_k, hidden, stride_y, stride_add, stride_out, HAS_ADD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Out[t] = dtype(sum_k Y[t * top_k + k]) (+ Add[t], rounded again): the top-k sum, the cast and the shared
    experts' add in one pass, rounding where the unfused torch code rounds."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, top_k):
        acc += tl.load(Y + (t * top_k + k) * stride_y + offs, mask=mask, other=0.0)
    dt = Out.dtype.element_ty
    out = round_to(acc, dt)
    if HAS_ADD:
        out = round_to(out + tl.load(Add + t * stride_add + offs, mask=mask, other=0.0).to(tl.float32), dt)
    tl.store(Out + t * stride_out + offs, out.to(dt), mask=mask)


@dataclass(frozen=True)
class GemmLaunch:
    """One expert GEMM's launch: output columns and K per step of a program, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """Rows per expert block (both GEMMs share the blocks), then each GEMM's launch. persistent: both GEMMs in one
    launch of one program per SM (`_moe_persistent_kernel`; its pipeline depth is the larger of the two's)."""

    block_m: int
    gate_up: GemmLaunch
    down: GemmLaunch
    persistent: bool = False


def work_entries(num_blocks: int) -> int:
    """int32 entries the persistent launch's `work` buffer needs for this many expert blocks."""
    return num_blocks + 2


def default_tiles(num_pairs: int, interpret: bool) -> MoETiles:
    """Small row blocks for decode (each expert gets few rows; many column tiles keep every SM reading
    weights), bigger ones once experts get many rows. Two launches, not the persistent one: session 16 timed one
    V2-Lite token's MoE at about 20 us less with it in isolation (sweep_fused_moe_persistent_h100_s16.json, L2
    flushed), but the V2-Lite batch-1 decode step with it as the default was no faster (3.08 / 3.26 ms against
    3.05 / 3.11, alternated processes: benchmarks/results/s16/persistent_moe_ab/)."""
    if interpret:
        return MoETiles(16, GemmLaunch(32, 32, 1, 1), GemmLaunch(32, 32, 1, 1))
    if num_pairs <= 1024:
        return MoETiles(16, GemmLaunch(64, 128, 4, 4), GemmLaunch(64, 128, 4, 4))
    return MoETiles(64, GemmLaunch(128, 64, 8, 3), GemmLaunch(128, 64, 8, 3))


def moe_block_m(pairs: int, interpret: bool = False) -> int:
    """Rows per expert block fused_moe uses for this many (token, choice) pairs (what `aligned` must have)."""
    return default_tiles(pairs, interpret).block_m


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              interpret: bool = False, add: torch.Tensor | None = None,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              tiles: MoETiles | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights/ids [T, k] -> sum_k w * expert(x) [T, H]
    (+ `add` [T, H], e.g. the shared experts' output, added after the sum is rounded to x's dtype).

    shared = (gate_up [2 S I, H] (S I gate rows, then S I up rows), down [H, S I]): S shared experts of width I
    as experts E..E+S-1, each I-wide slice of the shared MLP one of them (the MLP is the sum of its slices);
    ids/weights then carry them (ids E + s, weight 1), so their GEMMs run in the routed experts' launches.
    aligned: moe_align's result for these ids at `moe_block_m(pairs)` rows, made already (the fused router does
    it for one token), so that launch is skipped. tiles: the GEMMs' launch (None: `default_tiles`). work: for a
    persistent launch, int32 zeros with at least `work_entries(blocks)` entries that the launch leaves zero (keep
    one per stream, made outside graph capture; None: fresh ones)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    num_routed = experts
    if shared is not None:
        s_gate_up, s_down = shared
        n_shared = s_down.shape[1] // inter_size
        if (s_gate_up.shape != (2 * n_shared * inter_size, hidden) or s_down.shape != (hidden, n_shared * inter_size)
                or n_shared == 0 or s_gate_up.stride(-1) != 1 or s_down.stride(-1) != 1):
            raise ValueError(f"shared experts {tuple(s_gate_up.shape)} / {tuple(s_down.shape)} are not slices of "
                             f"width {inter_size} over hidden {hidden}")
        experts += n_shared
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    x = x.contiguous()
    tiles = tiles or default_tiles(pairs, interpret)
    block_m, up, down = tiles.block_m, tiles.gate_up, tiles.down
    sorted_ids, block_expert, block_rows = aligned if aligned is not None else moe_align(ids, experts, block_m)
    if sorted_ids.numel() != block_expert.numel() * block_m:
        raise ValueError(f"aligned blocks of {sorted_ids.numel() // max(1, block_expert.numel())} rows, "
                         f"the GEMMs take {block_m}")
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    # shared expert s of gate_up: gate rows s I.., up rows S I further; of down: columns s I.. of [H, S I]
    s13, s13_strides = (s_gate_up, (inter_size * s_gate_up.stride(0), s_gate_up.stride(0), n_shared * inter_size)
                        ) if shared is not None else (w13, (0, 0, 0))
    s2, s2_strides = (s_down, (inter_size, s_down.stride(0))) if shared is not None else (w2, (0, 0))
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    routing = weights.reshape(-1).float().contiguous()
    if tiles.persistent:
        need = work_entries(blocks)
        if work is None:
            work = torch.zeros(need, dtype=torch.int32, device=x.device)
        elif work.numel() < need or work.dtype != torch.int32:
            raise ValueError(f"fused_moe work buffer: {need} int32 zeros needed, got {work.numel()} {work.dtype}")
        # interpreted programs run one after another: the first takes every tile, the others only pass the exit ticket
        grid = 3 if interpret else min(num_sms(x.device), blocks * triton.cdiv(inter_size, up.block_n))
        _moe_persistent_kernel[(grid,)](
            x, w13, w2, inter, y, sorted_ids, block_expert, block_rows, routing, s13, s2, work,
            hidden, inter_size, top_k, num_routed, s13_strides[2], blocks,
            x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0), s13_strides[0], s13_strides[1],
            w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), s2_strides[0], s2_strides[1],
            IEEE=ieee, HAS_SHARED=shared is not None, BLOCK_M=block_m, UP_N=up.block_n, UP_K=up.block_k,
            DOWN_N=down.block_n, DOWN_K=down.block_k, BLOCK_B=min(1024, triton.next_power_of_2(blocks + 2)),
            num_warps=max(up.num_warps, down.num_warps), num_stages=max(up.num_stages, down.num_stages))
    else:
        _moe_gemm_kernel[(blocks, triton.cdiv(inter_size, up.block_n))](
            x, w13, inter, sorted_ids, block_expert, block_rows, x, s13,
            inter_size, hidden, inter_size, top_k, num_routed, s13_strides[2],
            x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), inter.stride(0), s13_strides[0],
            s13_strides[1], FUSE_SILU=True, ROUTED=False, IEEE=ieee, HAS_SHARED=shared is not None, BLOCK_M=block_m,
            BLOCK_N=up.block_n, BLOCK_K=up.block_k, num_warps=up.num_warps, num_stages=up.num_stages)
        _moe_gemm_kernel[(blocks, triton.cdiv(hidden, down.block_n))](
            inter, w2, y, sorted_ids, block_expert, block_rows, routing, s2,
            hidden, inter_size, 0, 1, num_routed, 0,
            inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), s2_strides[0], s2_strides[1],
            FUSE_SILU=False, ROUTED=True, IEEE=ieee, HAS_SHARED=shared is not None, BLOCK_M=block_m,
            BLOCK_N=down.block_n, BLOCK_K=down.block_k, num_warps=down.num_warps, num_stages=down.num_stages)
    out = torch.empty_like(x)
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    block = min(1024, triton.next_power_of_2(hidden)) if not interpret else min(64, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block))](
        y, add if add is not None else y, out, top_k, hidden, y.stride(0), add.stride(0) if add is not None else 0,
        out.stride(0), HAS_ADD=add is not None, BLOCK=block, num_warps=4 if not interpret else 1)
    return out
