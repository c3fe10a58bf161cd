"""Top-k columns of every row of a score matrix, listed in ascending column order, as one Triton kernel: VSA's pick.

Why: VSA keeps, for every (head, query block), the k best of ~1,000 key blocks by coarse score, and the block-sparse
kernel wants each list ascending. torch.topk (a radix select of four passes) then a sort of the picked ids took 0.42
+ 0.25 ms of a 9.9 ms VSA call at 18x48x80 on an H200 (session 29 profile); this kernel takes 0.22. Here one
program per row finds the k-th largest score by a bitwise search over an order-preserving 32-bit integer image of
the float32 scores (32 counting passes over the row, in registers), keeps the scores above it and the first ties at it,
and writes the kept column ids in ascending order through a prefix sum: no sort, no [rows x k] value tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import interpreted

MAX_COLUMNS = 8192  # one row in registers (BLOCK = the column count rounded up to a power of two)


@triton.jit
def _topk_ascending(S, Allowed, Out, n_cols, k, stride_s, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < n_cols
    allowed = tl.load(Allowed + offs, mask=inside, other=0) != 0
    bits = tl.load(S + row * stride_s + offs, mask=inside, other=0.0).to(tl.int32, bitcast=True)
    # order-preserving unsigned image: negatives flip their 31 low bits (signed order), then the sign bit flips
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.uint32, bitcast=True) ^ 0x80000000
    key = tl.where(allowed, key, 0)  # below every real score (0 is the image of one NaN pattern only)
    threshold = tl.zeros((), dtype=tl.uint32)
    for i in range(32):
        candidate = threshold | (tl.full((), 1, tl.uint32) << (31 - i))
        threshold = tl.where(tl.sum((key >= candidate).to(tl.int32), 0) >= k, candidate, threshold)
    above = key > threshold
    ties = (key == threshold) & allowed
    need = k - tl.sum(above.to(tl.int32), 0)
    keep = above | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= need))
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(Out + row * stride_o + slot, offs.to(tl.int32), mask=keep)


def kernel_serves(scores: torch.Tensor) -> bool:
    """float32 [..., N] on CUDA (or under the interpreter), N small enough for one row in registers."""
    return ((scores.is_cuda or interpreted()) and scores.dtype == torch.float32 and scores.stride(-1) == 1
            and 0 < scores.shape[-1] <= MAX_COLUMNS)


def topk_ascending(scores: torch.Tensor, k: int, allowed: torch.Tensor, num_warps: int = 1) -> torch.Tensor:
    """scores float32 [..., N], allowed bool [N] (columns that may be picked, at least k of them) -> int32
    [..., k]: the columns of the k largest allowed scores of every row, ascending. Ties at the k-th score keep
    the lowest columns. One warp a row measured fastest on an H200 (session 29, benchmarks/bench_vsa_planning.py:
    0.225 ms for 12,960 rows of 1,080 at k = 135, against 0.268 with four warps and 0.72 for torch.topk + sort;
    64-bit keys took 0.304)."""
    n = scores.shape[-1]
    rows = scores.reshape(-1, n)
    out = torch.empty(rows.shape[0], k, dtype=torch.int32, device=scores.device)
    if rows.shape[0]:
        _topk_ascending[(rows.shape[0],)](rows, allowed.to(torch.int8).contiguous(), out, n, k, rows.stride(0),
                                          out.stride(0), BLOCK=triton.next_power_of_2(n), num_warps=num_warps)
    return out.view(*scores.shape[:-1], k)


__all__ = ["MAX_COLUMNS", "kernel_serves", "topk_ascending"]
