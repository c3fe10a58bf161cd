"""Greedy next tokens: argmax over each row of the logits in two short Triton launches.

Why: torch's argmax runs one row of a 128K vocabulary as a single long reduction (about 27 us on an
H100 per decode step at batch 1); here many programs each reduce a chunk, and one small program per
row picks the winning chunk. Ties go to the lowest index, as torch.argmax does. The CUDA-graph runner
captures it with the model, so a greedy decode step launches nothing after the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048


@triton.jit
def _chunk_argmax(Logits, Part_Val, Part_Idx, vocab, stride_row, n_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, offs, vocab), 0)  # lowest index holding the chunk's maximum
    tl.store(Part_Val + row * n_chunks + chunk, best)
    tl.store(Part_Idx + row * n_chunks + chunk, first)


@triton.jit
def _row_argmax(Part_Val, Part_Idx, Out, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_chunks
    val = tl.load(Part_Val + row * n_chunks + offs, mask=mask, other=float("-inf"))
    idx = tl.load(Part_Idx + row * n_chunks + offs, mask=mask, other=0)
    best = tl.max(val, 0)
    first_chunk = tl.min(tl.where((val == best) & mask, offs, BLOCK), 0)  # chunks are in index order
    tl.store(Out + row, tl.sum(tl.where(offs == first_chunk, idx, 0), 0).to(tl.int64))


def greedy_argmax(logits: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """logits [rows, vocab] (float) -> int64 [rows]: torch.argmax(logits, -1) for finite logits."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_chunks = triton.cdiv(vocab, CHUNK)
    part_val = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax[(rows, n_chunks)](logits, part_val, part_idx, vocab, logits.stride(0), n_chunks, CHUNK=CHUNK,
                                    num_warps=4 if not interpret else 1)
    _row_argmax[(rows,)](part_val, part_idx, out, n_chunks, BLOCK=max(16, triton.next_power_of_2(n_chunks)),
                         num_warps=1)
    return out
