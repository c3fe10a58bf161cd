"""Batched k-means (Lloyd's algorithm, Euclidean) in plain torch: the clustering behind SVG2's permutation.

One independent problem per batch entry (SVG2: per batch row and head). Initial centroids are evenly strided
points (deterministic, and no draw from the global RNG that seeds the diffusion noise); later calls pass the
previous step's centroids (warm start, as Sparse-VideoGen does). Distances are computed a slice of problems at
a time so the [problems, points, clusters] score tensor stays bounded on long videos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SCORE_ELEMENTS = 1 << 27  # ~512 MB of float32 scores per slice


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


def assign(x: torch.Tensor, centroids: torch.Tensor, x_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest centroid of every point: argmin |x - c|^2 = argmin (|c|^2 - 2 x.c).

    `x_scores` is x in the dtype the x.c products run in (bf16 on GPUs: tensor cores; default x itself)."""
    xs = x if x_scores is None else x_scores
    p, n, _ = x.shape
    c = centroids.shape[1]
    step = max(1, MAX_SCORE_ELEMENTS // max(1, n * c))
    labels = torch.empty(p, n, dtype=torch.long, device=x.device)
    sq = (centroids * centroids).sum(-1)  # [P, C]
    cs = centroids.to(xs.dtype)
    for start in range(0, p, step):
        sl = slice(start, start + step)
        dist = sq[sl, None, :] - 2.0 * torch.bmm(xs[sl], cs[sl].transpose(1, 2)).to(sq.dtype)
        labels[sl] = dist.argmin(-1)
    return labels


def cluster_sizes(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    sizes = torch.zeros(labels.shape[0], clusters, dtype=torch.long, device=labels.device)
    return sizes.scatter_add_(1, labels, torch.ones_like(labels))


def update(x: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Mean of each cluster's points; an empty cluster keeps its centroid."""
    sums = torch.zeros_like(centroids).scatter_add_(1, labels[..., None].expand_as(x), x)
    counts = cluster_sizes(labels, centroids.shape[1])[..., None]
    return torch.where(counts > 0, sums / counts.clamp(min=1).to(x.dtype), centroids)


def kmeans(x: torch.Tensor, clusters: int, iters: int, init: torch.Tensor | None = None,
           tol: float = 1e-4, score_dtype: torch.dtype | None = None) -> KMeansResult:
    """Up to `iters` Lloyd iterations on x [P, N, D] (float32 or float64), from `init` or strided points.

    Stops early once no centroid moves more than `tol`. With iters == 0 the points are only assigned. Centroids
    are float means of x; `score_dtype` (e.g. bfloat16 on a GPU) is the dtype of the point-centroid products."""
    centroids = strided_init(x, clusters) if init is None else init.to(x.dtype)
    xs = None if score_dtype is None or score_dtype == x.dtype else x.to(score_dtype)
    labels = assign(x, centroids, xs)
    for _ in range(iters):
        moved = update(x, labels, centroids)
        shift = float((moved - centroids).norm(dim=-1).max()) if moved.numel() else 0.0
        centroids = moved
        labels = assign(x, centroids, xs)
        if shift < tol:
            break
    return KMeansResult(labels, centroids, cluster_sizes(labels, clusters))


__all__ = ["KMeansResult", "assign", "cluster_sizes", "kmeans", "strided_init", "update"]
