"""Nearest-centroid assignment for batched k-means in one Triton kernel: SVG2's clustering without a score tensor.

In torch the assignment writes a [problems, points, clusters] score tensor and reads it back for the argmin
(Wan 480p: 12 heads x 32,760 keys x 1,000 centroids = 393M scores per pass, three passes per warm call), so it
runs at memory speed. Here one program owns BLOCK_N points of one problem, keeps them in registers, and walks
the centroids BLOCK_K at a time: `|c|^2 - 2 x.c` from one tensor-core dot (fp32 accumulation), a running minimum
and its index. Nothing but the labels is written. Ties keep the lowest centroid index, as torch.argmin does.
Scores are the fp32-accumulated products of x and the centroids in x's dtype (the torch path rounds each product
to that dtype first, so near-ties may resolve differently); float32 inputs (the interpreter's tests) use exact
IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import dot, interpreted

FUSED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def _nearest_centroid(
    X, C, SQ, Labels, n_points, n_clusters,
    stride_xp, stride_xn, stride_cp, stride_ck,
    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    x = tl.load(X + p * stride_xp + rows[:, None].to(tl.int64) * stride_xn + dims[None, :],
                mask=rows[:, None] < n_points, other=0.0)
    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_k = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, n_clusters, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c = tl.load(C + p * stride_cp + cols[:, None] * stride_ck + dims[None, :], mask=cols[:, None] < n_clusters,
                    other=0.0)
        sq = tl.load(SQ + p * n_clusters + cols, mask=cols < n_clusters, other=float("inf"))
        score = sq[None, :] - 2.0 * dot(x, tl.trans(c), IEEE)
        tile_best = tl.min(score, axis=1)
        tile_k = tl.argmin(score, axis=1).to(tl.int32) + k0
        better = tile_best < best  # strict: an equal later tile keeps the lower index
        best = tl.where(better, tile_best, best)
        best_k = tl.where(better, tile_k, best_k)
    tl.store(Labels + p * n_points + rows, best_k.to(tl.int64), mask=rows < n_points)


def fused_assign_supported(x: torch.Tensor) -> bool:
    """The kernel serves CUDA half-precision scores (and anything under the Triton interpreter)."""
    if x.dim() != 3 or x.shape[-1] not in HEAD_DIMS:
        return False
    return interpreted() or (x.is_cuda and x.dtype in FUSED_DTYPES)


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor, block_n: int = 128, block_k: int = 64
                     ) -> torch.Tensor:
    """x [P, N, D], centroids [P, C, D] (float, any dtype) -> int64 [P, N]: argmin_c |c|^2 - 2 x.c, with the
    products in x's dtype and |c|^2 from the float centroids."""
    p, n, d = x.shape
    c = centroids.shape[1]
    sq = (centroids.float() * centroids.float()).sum(-1).contiguous()  # [P, C]
    cs = centroids.to(x.dtype).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    labels = torch.empty(p, n, dtype=torch.long, device=x.device)
    if p == 0 or n == 0:
        return labels
    if interpreted():
        block_n, block_k = min(block_n, 32), min(block_k, 32)
    grid = (triton.cdiv(n, block_n), p)
    _nearest_centroid[grid](x, cs, sq, labels, n, c, x.stride(0), x.stride(1), cs.stride(0), cs.stride(1),
                            D=d, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                            num_warps=8 if d >= 128 else 4, num_stages=2)  # not tuned: no GPU run yet
    return labels


__all__ = ["fused_assign_supported", "nearest_centroid"]
