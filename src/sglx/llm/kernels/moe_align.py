"""Expert alignment for fused MoE: (token, choice) pairs sorted stably by expert into blocks of BLOCK_M rows.

Why its own kernels: fused_moe's GEMMs need every block to belong to one expert, and the sort must run on the device
without a host sync (CUDA graphs capture it). Two launch shapes:
- few pairs (decode batches): one program walks the pairs twice (counts, then ranks), one launch;
- many pairs (prefill, larger decode batches): three launches that scale with the pairs. Each of many programs
  counts its slice of pairs per expert; one program turns those counts into each expert's padded run and each
  slice's first row per expert (an exclusive scan over slices); the programs then place their pairs, ranked within
  the slice, so the order stays stable across slices, and write their share of the block table.
Both give the same layout (rows past an expert's pairs are left unwritten).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import num_sms


@triton.jit
def _block_table(counts, pad_start, pad_end, Block_Expert, Block_Rows, block0, block_step, num_blocks,
                 E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Per block of BLOCK_M sorted rows: its expert (-1: past every expert's run) and how many of its rows are real;
    for the CHUNK blocks from `block0`, then every `block_step` blocks on."""
    experts = tl.arange(0, BLOCK_E)
    real = experts < E
    for start in range(block0, num_blocks, block_step):
        blocks = start + tl.arange(0, CHUNK)
        row0 = blocks * BLOCK_M
        owner = tl.sum(((pad_end[None, :] <= row0[:, None]) & real[None, :]).to(tl.int32), 1)
        mine = (experts[None, :] == owner[:, None]).to(tl.int32)
        first = tl.sum(pad_start[None, :] * mine, 1)
        count = tl.sum(counts[None, :] * mine, 1)
        rows = tl.minimum(tl.maximum(count - (row0 - first), 0), BLOCK_M)
        used = owner < E
        tl.store(Block_Expert + blocks, tl.where(used, owner, -1), mask=blocks < num_blocks)
        tl.store(Block_Rows + blocks, tl.where(used, rows, 0), mask=blocks < num_blocks)


@triton.jit
def _place_pairs(Ids, Sorted_Ids, first_row, start, stop, num_pairs,
                 BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs start..stop to their sorted rows: first_row[e] (this slice's first row for expert e) plus the pair's
    rank among the slice's earlier pairs of e."""
    experts = tl.arange(0, BLOCK_E)
    seen = first_row
    for s in range(start, stop, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        live = (offs < num_pairs) & (offs < stop)
        e = tl.load(Ids + offs, mask=live, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        dest = tl.sum((tl.cumsum(onehot, 0) - 1 + seen[None, :]) * onehot, 1)
        tl.store(Sorted_Ids + dest, offs, mask=live)
        seen += tl.sum(onehot, 0)


@triton.jit
def _count_pairs(Ids, start, stop, num_pairs, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert among pairs start..stop."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(start, stop, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        e = tl.load(Ids + offs, mask=(offs < num_pairs) & (offs < stop), other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    return counts


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    """Each expert's run padded to whole blocks: (start row, end row)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    return pad_end - padded, pad_end


@triton.jit
def _align_one_program(Ids, Sorted_Ids, Block_Expert, Block_Rows, num_pairs, num_blocks,
                       E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The whole alignment in one program (few pairs: one launch)."""
    counts = _count_pairs(Ids, 0, num_pairs, num_pairs, BLOCK_E, CHUNK)
    pad_start, pad_end = _padded_runs(counts, BLOCK_M)
    _place_pairs(Ids, Sorted_Ids, pad_start, 0, num_pairs, num_pairs, BLOCK_E, CHUNK)
    _block_table(counts, pad_start, pad_end, Block_Expert, Block_Rows, 0, CHUNK, num_blocks, E, BLOCK_E, BLOCK_M,
                 CHUNK)


@triton.jit
def _align_count_kernel(Ids, Slice_Counts, num_pairs, PER_PROGRAM: tl.constexpr, BLOCK_E: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Step 1 of 3: this program's slice of pairs counted per expert, into its row of Slice_Counts."""
    pid = tl.program_id(0)
    start = pid * PER_PROGRAM
    counts = _count_pairs(Ids, start, start + PER_PROGRAM, num_pairs, BLOCK_E, CHUNK)
    tl.store(Slice_Counts + pid * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _align_scan_kernel(Slice_Counts, Runs, num_slices, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                       SLICES: tl.constexpr):
    """Step 2 of 3 (one program): experts' totals and padded runs (Runs: counts, run starts, run ends), and in place
    of each slice's counts its first row per expert (the run's start plus the earlier slices' pairs of that
    expert)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s0 in range(0, num_slices, SLICES):
        rows = s0 + tl.arange(0, SLICES)
        tile = tl.load(Slice_Counts + rows[:, None] * BLOCK_E + experts[None, :], mask=rows[:, None] < num_slices,
                       other=0)
        counts += tl.sum(tile, 0)
    pad_start, pad_end = _padded_runs(counts, BLOCK_M)
    running = pad_start
    for s0 in range(0, num_slices, SLICES):
        rows = s0 + tl.arange(0, SLICES)
        ptrs = Slice_Counts + rows[:, None] * BLOCK_E + experts[None, :]
        live = rows[:, None] < num_slices
        tile = tl.load(ptrs, mask=live, other=0)
        tl.store(ptrs, tl.cumsum(tile, 0) - tile + running[None, :], mask=live)
        running += tl.sum(tile, 0)
    tl.store(Runs + experts, counts)
    tl.store(Runs + BLOCK_E + experts, pad_start)
    tl.store(Runs + 2 * BLOCK_E + experts, pad_end)


@triton.jit
def _align_place_kernel(Ids, Sorted_Ids, Slice_Counts, Runs, Block_Expert, Block_Rows, num_pairs, num_blocks,
                        E: tl.constexpr, PER_PROGRAM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Step 3 of 3: this program's slice of pairs to their sorted rows, and its share of the block table (CHUNK
    blocks at a time, every program's CHUNK in turn)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    first_row = tl.load(Slice_Counts + pid * BLOCK_E + experts)
    start = pid * PER_PROGRAM
    _place_pairs(Ids, Sorted_Ids, first_row, start, start + PER_PROGRAM, num_pairs, BLOCK_E, CHUNK)
    counts = tl.load(Runs + experts)
    pad_start = tl.load(Runs + BLOCK_E + experts)
    pad_end = tl.load(Runs + 2 * BLOCK_E + experts)
    _block_table(counts, pad_start, pad_end, Block_Expert, Block_Rows, pid * CHUNK, tl.num_programs(0) * CHUNK,
                 num_blocks, E, BLOCK_E, BLOCK_M, CHUNK)


# Up to this many pairs one program aligns them (one launch); past it, three launches over many programs. H200,
# session 30 (benchmarks/results/s30/call6/moe_align.json, bench_moe_align.py), us a call replayed in a CUDA graph,
# one program / three launches: DeepSeek-V2-Lite's routing (66 experts, 8 pairs a token) 7.9 / 7.9 at 64 pairs,
# 12.4 / 8.0 at 128, 26.6 / 7.8 at 512, 163 / 13.1 at 4,096, 62.7 (three launches) at 262,144 where the torch sort
# takes 239; DeepSeek-V3's (257 experts) 16.8 / 7.0 at 72 pairs, 77.6 / 9.4 at 576. Eagerly the one launch costs
# the host less (40-50 against 90-120 us a call), so it keeps the smallest batches.
ONE_PROGRAM_MAX_PAIRS = 64
# The most pairs one program of the three-launch path counts and places.
MAX_PAIRS_PER_PROGRAM = 1024


def blocks_bound(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that any routing of `pairs` pairs over `num_experts` experts fits (host-side bound)."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def _chunk(block_e: int) -> int:
    """Pairs a program compares against every expert at once (a [CHUNK, BLOCK_E] one-hot stays ~4k entries)."""
    return max(16, min(128, 4096 // block_e))


def pairs_per_program(pairs: int, device: torch.device, chunk: int) -> int:
    """Slice of the three-launch path: about two slices an SM, a power of two from one chunk to
    MAX_PAIRS_PER_PROGRAM."""
    want = triton.next_power_of_2(triton.cdiv(pairs, 2 * num_sms(device)))
    return max(chunk, min(MAX_PAIRS_PER_PROGRAM, want))


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted pair ids [blocks * block_m] int32, expert of each block [blocks] int32 (-1 unused),
    real rows of each block [blocks] int32). The block count is a bound known on the host (no sync).
    one_program: force (True) or forbid (False) the one-launch path; None: by ONE_PROGRAM_MAX_PAIRS."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    blocks = blocks_bound(pairs, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = _chunk(block_e)
    if pairs <= ONE_PROGRAM_MAX_PAIRS if one_program is None else one_program:
        _align_one_program[(1,)](flat, sorted_ids, block_expert, block_rows, pairs, blocks,
                                 E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
        return sorted_ids, block_expert, block_rows
    per = pairs_per_program(pairs, ids.device, chunk)
    slices = triton.cdiv(pairs, per)
    scratch = torch.empty(slices + 3, block_e, dtype=torch.int32, device=ids.device)
    slice_counts, runs = scratch[:slices], scratch[slices:]
    _align_count_kernel[(slices,)](flat, slice_counts, pairs, PER_PROGRAM=per, BLOCK_E=block_e, CHUNK=chunk,
                                   num_warps=4)
    _align_scan_kernel[(1,)](slice_counts, runs, slices, BLOCK_E=block_e, BLOCK_M=block_m,
                             SLICES=max(1, 4096 // block_e), num_warps=4)
    _align_place_kernel[(slices,)](flat, sorted_ids, slice_counts, runs, block_expert, block_rows, pairs, blocks,
                                   E=num_experts, PER_PROGRAM=per, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=chunk,
                                   num_warps=4)
    return sorted_ids, block_expert, block_rows
