"""SVG2's fused nearest-centroid kernel on the GPU: the labels torch's argmin gives (well-separated clusters, so
bf16 rounding cannot flip them), and a warm k-means through it equal to the torch assignment's."""

from __future__ import annotations

import pytest
import torch

from sglx.attention.diffusion.sparse import kmeans as kmeans_module
from sglx.attention.kernels.kmeans_assign import nearest_centroid

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _points(p: int, n: int, c: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(p, c, d, generator=gen) * 8
    which = torch.randint(0, c, (p, n), generator=gen)
    x = centres.gather(1, which[..., None].expand(-1, -1, d)) + 0.2 * torch.randn(p, n, d, generator=gen)
    return x.cuda(), (centres + 0.05 * torch.randn(p, c, d, generator=gen)).cuda()


@pytest.mark.parametrize("p,n,c,d", [(12, 4099, 1000, 128), (4, 1000, 300, 64), (2, 77, 3, 128)])
def test_nearest_centroid_matches_float64_argmin(p, n, c, d):
    x, centroids = _points(p, n, c, d)
    got = nearest_centroid(x.bfloat16(), centroids)
    want = torch.cdist(x.double(), centroids.double()).argmin(-1)
    assert torch.equal(got, want)


def test_kmeans_fused_equals_torch_assignment(monkeypatch):
    x, centroids = _points(4, 2000, 50, 128)
    monkeypatch.setenv(kmeans_module.ASSIGN_ENV, "torch")
    plain = kmeans_module.kmeans(x, 50, 2, init=centroids, x_scores=x.bfloat16())
    monkeypatch.setenv(kmeans_module.ASSIGN_ENV, "triton")
    fused = kmeans_module.kmeans(x, 50, 2, init=centroids, x_scores=x.bfloat16())
    assert torch.equal(fused.labels, plain.labels)
    assert torch.allclose(fused.centroids, plain.centroids, atol=1e-5)


def test_segment_update_matches_index_add_update(monkeypatch):
    """The CUDA default centroid update (sorted segment means) against torch's index_add_ update on SVG2's key
    shape (12 problems, 4,099 points, 1,000 clusters: some empty), float32."""
    x, centroids = _points(12, 4099, 1000, 128)
    labels = torch.randint(0, 1000, (12, 4099), device=x.device)
    labels[:, :7] = 999  # one crowded cluster, and (with 1,000 clusters for 4,099 points) empty ones
    monkeypatch.setenv(kmeans_module.UPDATE_ENV, "torch")
    want = kmeans_module.update(x, labels, centroids)
    monkeypatch.setenv(kmeans_module.UPDATE_ENV, "triton")
    assert kmeans_module.fused_update(x) is not None
    got = kmeans_module.update(x, labels, centroids)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
