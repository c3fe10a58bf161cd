"""Mean of the real tokens of every block of a tile-ordered sequence, as one Triton kernel: VSA's and VMoBA's pooling.

Why: the torch pooling casts the whole [B, slots, H, D] tensor to float32 (a strided copy) and then runs a
weighted einsum that becomes a batched GEMV: on the H100, VSA at 18x48x80 spent 0.73 ms on the two casts and
0.36 ms on the two GEMVs of one call (session 12 profile) to pool 42 MB of bf16. Here one program reads one
block's real rows of a column chunk once, in x's dtype, and sums them in float32: padding slots (which repeat token
0 at the end of a block) are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import interpreted


@triton.jit
def _block_means(X, Lengths, Out, slots, width, block, stride_xb, stride_xs, stride_ob, stride_on,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    length = tl.load(Lengths + n)
    offs = tl.arange(0, BLOCK)
    rows = n * block + offs  # BLOCK: the block size rounded up to a power of two
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ((offs < length) & (rows < slots))[:, None] & (cols < width)[None, :]
    x = tl.load(X + b * stride_xb + rows[:, None].to(tl.int64) * stride_xs + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(x.to(tl.float32), 0)
    mean = total / tl.maximum(length, 1).to(tl.float32)
    tl.store(Out + b * stride_ob + n * stride_on + cols, mean, mask=cols < width)


def kernel_serves(x: torch.Tensor) -> bool:
    """x [B, slots, H, D] with packed heads and unit last stride, on CUDA (or under the interpreter)."""
    return (x.dim() == 4 and (x.is_cuda or interpreted()) and x.stride(3) == 1 and x.stride(2) == x.shape[3]
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32))


def block_means_kernel(x: torch.Tensor, lengths: torch.Tensor, block: int, block_c: int = 64,
                       num_warps: int = 1) -> torch.Tensor:
    """x [B, slots, H, D] in tile order, lengths int32 [num_blocks] (real tokens at the start of each block) ->
    float32 [B, H, num_blocks, D]: each block's mean over its real tokens (0 for a block without any).
    `block_c` columns a program sums with `num_warps` warps: 64 columns and one warp measured fastest on an H200
    (benchmarks/bench_vsa_planning.py, session 29: 64-token blocks, 12x128 columns, 0.065 against 0.105 ms for 256
    columns and 4 warps at 69,120 tokens)."""
    b, slots, h, d = x.shape
    nb = lengths.shape[0]
    width = h * d
    out = torch.empty(b, nb, h, d, dtype=torch.float32, device=x.device)
    if b == 0 or nb == 0:
        return out.permute(0, 2, 1, 3)
    block_c = min(block_c, triton.next_power_of_2(width))
    grid = (nb, triton.cdiv(width, block_c), b)
    _block_means[grid](x, lengths, out, slots, width, block, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                       BLOCK=triton.next_power_of_2(block), BLOCK_C=block_c, num_warps=num_warps)
    return out.permute(0, 2, 1, 3)


__all__ = ["block_means_kernel", "kernel_serves"]
