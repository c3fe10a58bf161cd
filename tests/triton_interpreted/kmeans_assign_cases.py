"""Interpreted cases (TRITON_INTERPRET=1): the fused nearest-centroid kernel against torch's argmin."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_sparse_plan_host_reads.py"

from sglx.attention.diffusion.sparse.kmeans import assign  # noqa: E402
from sglx.attention.kernels.kmeans_assign import fused_assign_supported, nearest_centroid  # noqa: E402


@pytest.mark.parametrize("p,n,c,d", [(2, 70, 5, 16), (3, 33, 40, 32), (1, 100, 1, 64)])
def test_nearest_centroid_equals_torch_argmin(p, n, c, d):
    gen = torch.Generator().manual_seed(p * 100 + c)
    centres = torch.randn(p, c, d, generator=gen) * 4
    which = torch.randint(0, c, (p, n), generator=gen)
    x = centres.gather(1, which[..., None].expand(-1, -1, d)) + 0.3 * torch.randn(p, n, d, generator=gen)
    centroids = centres + 0.1 * torch.randn(p, c, d, generator=gen)
    assert fused_assign_supported(x)
    got = nearest_centroid(x, centroids)
    want = torch.cdist(x.double(), centroids.double()).argmin(-1)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(got, assign(x, centroids))  # the torch path (CPU) agrees


def test_ties_keep_the_lowest_centroid_across_tiles():
    x = torch.zeros(1, 5, 16)
    centroids = torch.zeros(1, 70, 16)  # 70 identical centroids over three 32-wide tiles
    assert nearest_centroid(x, centroids).tolist() == [[0] * 5]
    centroids[0, 65] = -0.0
    centroids[0, :65] += 1.0  # only 65.. stay nearest: the first of them wins
    assert nearest_centroid(x, centroids).tolist() == [[65] * 5]


@pytest.mark.parametrize(("p", "n", "c", "d"), [(3, 200, 7, 16), (2, 50, 60, 64), (1, 1, 4, 128)])
def test_segment_update_equals_index_add_means(p, n, c, d):
    """The atomic-free centroid update: each cluster's mean of its points (float64 here, so the summation order
    cannot matter), an empty cluster keeping its old centroid (c > n forces some)."""
    from sglx.attention.diffusion.sparse.kmeans import update
    from sglx.attention.kernels.kmeans_update import segment_update, segment_update_supported

    g = torch.Generator().manual_seed(p * n + c)
    x = torch.randn(p, n, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, c, (p, n), generator=g)
    old = torch.randn(p, c, d, generator=g, dtype=torch.float64)
    assert segment_update_supported(x)
    got = segment_update(x, labels, old)
    want = update(x, labels, old)  # CPU tensors: torch's index_add_ update
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    empty = torch.ones(p, c, dtype=torch.bool)
    empty.scatter_(1, labels, False)
    assert torch.equal(got[empty], old[empty])
