"""out[i] = src[rows[i]] for rows of a 2-D tensor, as one Triton kernel: SVG2's per-head permutations.

Why: SVG2 moves q, k, v into cluster order and the output back in every sparse layer (Wan 480p: four tensors of
32,760 x 12 rows of 256 bytes). On the H100 torch's `index_select` ran 295 us a tensor for that (session 12
profile, about a third of the copy bandwidth) and the element-wise `gather` 217 us; here each program copies
BLOCK_R whole rows with one index load per row, at memory speed. CPU tensors and the interpreter's tests go
through the same kernel where Triton runs, else `index_select`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import interpreted


@triton.jit
def _gather_rows(Src, Rows, Out, n_rows, width, stride_src, stride_out,
                 BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < n_rows
    src_rows = tl.load(Rows + offs_r, mask=r_mask, other=0).to(tl.int64)
    for w0 in range(0, width, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        mask = r_mask[:, None] & (cols < width)[None, :]
        vals = tl.load(Src + src_rows[:, None] * stride_src + cols[None, :], mask=mask)
        tl.store(Out + offs_r[:, None].to(tl.int64) * stride_out + cols[None, :], vals, mask=mask)


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """src [R, W] (unit last stride), rows int [N] with values in [0, R) -> [N, W] = src.index_select(0, rows)."""
    if src.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"gather_rows takes src [R, W] and rows [N]; got {tuple(src.shape)}, {tuple(rows.shape)}")
    if not (src.is_cuda or interpreted()) or src.stride(1) != 1:
        return src.index_select(0, rows)
    n, width = rows.shape[0], src.shape[1]
    out = torch.empty(n, width, dtype=src.dtype, device=src.device)
    if n == 0 or width == 0:
        return out
    block_w = min(256, triton.next_power_of_2(width))
    block_r = max(1, min(64, 8192 // block_w))
    _gather_rows[(triton.cdiv(n, block_r),)](src, rows, out, n, width, src.stride(0), out.stride(0),
                                            BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4)
    return out


__all__ = ["gather_rows"]
