"""Batched k-means (Lloyd's algorithm, Euclidean) in plain torch: the clustering behind SVG2's permutation.

One independent problem per batch entry (SVG2: per batch row and head). Initial centroids are evenly strided
points (deterministic, and no draw from the global RNG that seeds the diffusion noise); later calls pass the
previous step's centroids (warm start, as Sparse-VideoGen does). Distances are computed a slice of problems at
a time so the [problems, points, clusters] score tensor stays bounded on long videos.

Kept cheap on a GPU (SVG2 runs it in every sparse layer): the loop never reads a tensor back to the host except
every CHECK_EVERY iterations (a long first clustering may stop early; a warm start's 2 iterations never wait
for the GPU). Once the largest centroid shift falls below `tol` the centroids freeze on the device, so further
iterations reassign to the same centroids and the result equals stopping there. Distances are one GEMM plus
one fused `|c|^2 - 2 x.c` (no float copies of the score tensor), and centroid sums are one `index_add_` over
flattened (problem, cluster) rows instead of a scatter through a [P, N, D] index. On CUDA with half-precision
scores the assignment is one Triton kernel (sglx.attention.kernels.kmeans_assign) that never writes the score
tensor: the default there since it passed its GPU tests and halved SVG2's warm call in three H100 runs (sessions 7,
10, 11: 21.0-21.1 ms with torch's assignment, 9.98-10.1 ms fused). SGLX_KMEANS_ASSIGN=torch turns it off. On CUDA
the update is likewise one Triton kernel over points sorted by cluster (sglx.attention.kernels.kmeans_update: no float
atomics, a fixed summation order); SGLX_KMEANS_UPDATE=torch turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_SCORE_ELEMENTS = 1 << 27  # ~512 MB of float32 scores per slice
ASSIGN_ENV = "SGLX_KMEANS_ASSIGN"  # "torch": torch's assignment everywhere; unset or "triton": fused where it runs
UPDATE_ENV = "SGLX_KMEANS_UPDATE"  # "torch": index_add_ updates everywhere; unset or "triton": sorted segment means


@dataclass(frozen=True)
class KMeansResult:
    labels: torch.Tensor  # int64 [P, N]: cluster of every point (from the last assignment)
    centroids: torch.Tensor  # [P, C, D] after the last update
    sizes: torch.Tensor  # int64 [P, C]: points per cluster in `labels`


def strided_init(x: torch.Tensor, clusters: int) -> torch.Tensor:
    """Centroids at evenly spaced points of x [P, N, D] -> [P, C, D] (C <= N)."""
    n = x.shape[1]
    picks = torch.arange(clusters, device=x.device) * n // clusters
    return x.index_select(1, picks).clone()


def _kernel_on(env: str) -> bool:
    """A k-means Triton kernel's switch: on unless its variable names another implementation (e.g. "torch")."""
    return os.environ.get(env, "triton").strip().lower() == "triton"


def fused_assign(xs: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The Triton assignment kernel where it serves these scores (CUDA, fp16/bf16), else None."""
    if not xs.is_cuda or xs.dtype not in (torch.float16, torch.bfloat16) or not _kernel_on(ASSIGN_ENV):
        return None
    try:
        from sglx.attention.kernels.kmeans_assign import fused_assign_supported, nearest_centroid
    except ImportError:
        return None
    return nearest_centroid if fused_assign_supported(xs) else None


def fused_update(x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The atomic-free Triton centroid update where it serves these points (CUDA float32/64), else None."""
    if not x.is_cuda or not _kernel_on(UPDATE_ENV):
        return None
    try:
        from sglx.attention.kernels.kmeans_update import segment_update, segment_update_supported
    except ImportError:
        return None
    return segment_update if segment_update_supported(x) else None


def assign(x: torch.Tensor, centroids: torch.Tensor, x_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest centroid of every point: argmin |x - c|^2 = argmin (|c|^2 - 2 x.c).

    `x_scores` is x in the dtype the x.c products run in (bf16 on GPUs: tensor cores; default x itself)."""
    xs = x if x_scores is None else x_scores
    kernel = fused_assign(xs)
    if kernel is not None:
        return kernel(xs, centroids)
    p, n, _ = x.shape
    c = centroids.shape[1]
    step = max(1, MAX_SCORE_ELEMENTS // max(1, n * c))
    sq = (centroids * centroids).sum(-1)[:, None, :]  # [P, 1, C]
    cs = centroids.to(xs.dtype).transpose(1, 2)
    if step >= p:  # one slice (the usual case): no output buffer, no copy
        return torch.add(sq, torch.bmm(xs, cs), alpha=-2.0).argmin(-1)
    labels = torch.empty(p, n, dtype=torch.long, device=x.device)
    for start in range(0, p, step):
        sl = slice(start, start + step)
        # |c|^2 - 2 (x.c): the product promoted to sq's dtype inside the add (exact x2), one rounding
        torch.argmin(torch.add(sq[sl], torch.bmm(xs[sl], cs[sl]), alpha=-2.0), -1, out=labels[sl])
    return labels


def _flat(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """Labels [P, N] -> row indices into a [P * clusters] table."""
    offsets = torch.arange(labels.shape[0], device=labels.device)[:, None] * clusters
    return (labels + offsets).reshape(-1)


def cluster_sizes(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    sizes = torch.zeros(labels.shape[0], clusters, dtype=torch.long, device=labels.device)
    return sizes.scatter_add_(1, labels, torch.ones_like(labels))


def update(x: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor, offsets: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Mean of each cluster's points; an empty cluster keeps its centroid. `offsets` [P, 1]: p * C (kept by
    a caller that updates many times)."""
    kernel = fused_update(x)
    if kernel is not None:  # CUDA: sorted segment means, no float atomics (sglx.attention.kernels.kmeans_update)
        return kernel(x, labels, centroids)
    p, n, d = x.shape
    c = centroids.shape[1]
    rows = _flat(labels, c) if offsets is None else (labels + offsets).reshape(-1)
    sums = x.new_zeros(p * c, d).index_add_(0, rows, x.reshape(p * n, d)).view(p, c, d)
    counts = x.new_zeros(p * c).index_add_(0, rows, x.new_ones(1).expand(p * n)).view(p, c, 1)
    return torch.where(counts > 0, sums / counts.clamp(min=1), centroids)


CHECK_EVERY = 8  # iterations between host reads of the convergence flag


def kmeans(x: torch.Tensor, clusters: int, iters: int, init: torch.Tensor | None = None,
           tol: float = 1e-4, score_dtype: torch.dtype | None = None,
           x_scores: torch.Tensor | None = None) -> KMeansResult:
    """Up to `iters` Lloyd iterations on x [P, N, D] (float32 or float64), from `init` or strided points.

    Stops once no centroid moves more than `tol` (the centroids freeze on the device at that iteration; the host
    looks every CHECK_EVERY iterations to skip the rest). With iters == 0 the points are only assigned.
    Centroids are float means of x; `score_dtype` (e.g. bfloat16 on a GPU) is the dtype of the point-centroid
    products, and `x_scores` x already in it (saves a cast when the caller has it)."""
    centroids = strided_init(x, clusters) if init is None else init.to(x.dtype)
    xs = x_scores
    if xs is None and score_dtype is not None and score_dtype != x.dtype:
        xs = x.to(score_dtype)
    labels = assign(x, centroids, xs)
    offsets = torch.arange(x.shape[0], device=x.device)[:, None] * clusters
    done: torch.Tensor | None = None  # 0-dim bool on x's device: converged at an earlier iteration
    for i in range(iters):
        moved = update(x, labels, centroids, offsets)
        if not moved.numel():
            break
        last = i == iters - 1
        converged = None if last else (moved - centroids).norm(dim=-1).amax().double() < tol
        centroids = moved if done is None else torch.where(done, centroids, moved)
        labels = assign(x, centroids, xs)  # frozen centroids: the same labels again
        if converged is not None:
            done = converged if done is None else done | converged
            if (i + 1) % CHECK_EVERY == 0 and bool(done):
                break
    return KMeansResult(labels, centroids, cluster_sizes(labels, clusters))


__all__ = ["ASSIGN_ENV", "CHECK_EVERY", "UPDATE_ENV", "KMeansResult", "assign", "cluster_sizes", "fused_assign",
           "fused_update", "kmeans", "strided_init", "update"]
