"""Interpreted cases (TRITON_INTERPRET=1): VSA, VMoBA and SVG2 through the Triton block-sparse kernel (route forced
to triton on CPU) against float64 masked attention under the same plan: their layouts (cube blocks of 64, chunk
blocks with padded keys, per-head cluster permutations) are ones the kernel takes."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_sparse_backends.py"
os.environ["SGLX_BLOCK_SPARSE_ROUTE"] = "triton"

from sglx.attention.diffusion.metadata import DiTAttnMetadata  # noqa: E402
from sglx.attention.diffusion.sparse.reference import masked_attention  # noqa: E402
from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend, permute, unpermute  # noqa: E402
from sglx.attention.diffusion.sparse.tiled import from_order, to_order  # noqa: E402
from sglx.attention.diffusion.sparse.video_sparse import VideoSparseAttentionBackend, vsa_plan  # noqa: E402
from sglx.attention.diffusion.sparse.vmoba import VMoBABackend, vmoba_plan  # noqa: E402

META = DiTAttnMetadata(grid=(3, 5, 6), num_heads=4, head_dim=64, text_tokens=7, text_position="prefix",
                       step_index=1, num_steps=2, num_layers=2)


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, META.seq_len, h, 64, generator=g) for h in (4, 2, 2))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), err


def test_vsa_through_the_kernel():
    q, k, v = _qkv()
    got = VideoSparseAttentionBackend({"sparsity": 0.5}).forward(q, k, v, scale=0.2, meta=META, layer=0)
    plan = vsa_plan(q, k, META, 0.5, 0.2)
    qs, ks, vs = (to_order(t.double(), plan.order) for t in (q, k, v))
    _close(got, from_order(masked_attention(qs, ks, vs, plan.layout, 0.2), plan.order))


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_vmoba_through_the_kernel(layer):
    q, k, v = _qkv()
    backend = VMoBABackend({"first_full_step": 0, "temporal_chunk_size": 1, "spatial_chunk_size": [2, 3],
                            "st_chunk_size": [2, 2, 3], "moba_threshold": 0.4})
    got = backend.forward(q, k, v, scale=0.2, meta=META, layer=layer)
    plan = vmoba_plan(q, k, META, backend.vmoba, backend.layer_kind(META, layer))  # type: ignore[arg-type]
    assert plan.layout.k_lengths is not None  # chunks padded to whole blocks
    qs, ks, vs = (to_order(t.double(), plan.order) for t in (q, k, v))
    _close(got, from_order(masked_attention(qs, ks, vs, plan.layout, 0.2), plan.order))


def test_svg2_through_the_kernel():
    q, k, v = _qkv()
    backend = SparseVideoGen2Backend({"num_q_centroids": 5, "num_k_centroids": 9, "top_p_kmeans": 0.5,
                                      "min_kc_ratio": 0.0, "first_times_fp": 0.0, "first_layers_fp": 0.0})
    got = backend.forward(q, k, v, scale=0.2, meta=META, layer=0)
    plan = backend.last_plan
    assert plan is not None
    out = masked_attention(permute(q.double(), plan.q_index), permute(k.double(), plan.k_index),
                           permute(v.double(), plan.k_index), plan.layout, 0.2)
    _close(got, unpermute(out, plan.q_slot))


@pytest.mark.parametrize(("n_src", "width", "n"), [(50, 128, 77), (9, 40, 300), (1000, 512, 1), (3, 64, 0)])
def test_gather_rows_equals_index_select(n_src, width, n):
    """SVG2's row gather: whole rows in any order and multiplicity, widths that are not a power of two or wider
    than one tile, an empty selection; bit-identical to index_select."""
    from sglx.attention.kernels.row_gather import gather_rows

    g = torch.Generator().manual_seed(n_src)
    src = torch.randn(n_src, width, generator=g).to(torch.float16)
    rows = torch.randint(0, n_src, (n,), generator=g)
    got = gather_rows(src, rows)
    assert got.shape == (n, width) and torch.equal(got, src.index_select(0, rows))


@pytest.mark.parametrize(("grid", "box", "text", "block"), [
    ((3, 6, 8), (2, 4, 4), 0, 16), ((5, 7, 9), (4, 4, 4), 3, 64), ((2, 3, 5), (1, 3, 5), 2, 16)])
def test_block_means_kernel_equals_the_weighted_pooling(grid, box, text, block):
    """VSA/VMoBA pooling's kernel: each block's mean over its real tokens only (padding repeats token 0 and is
    skipped), partial last blocks and text blocks included; equal to the float32 weighted einsum of the CPU path."""
    from sglx.attention.diffusion.sparse.tile_order import tile_order
    from sglx.attention.diffusion.sparse.tiled import block_means, real_lengths
    from sglx.attention.kernels.block_means import block_means_kernel, kernel_serves

    order = tile_order(grid, box, text, True, block)
    g = torch.Generator().manual_seed(block + text)
    x = to_order(torch.randn(2, grid[0] * grid[1] * grid[2] + text, 3, 16, generator=g), order)
    assert kernel_serves(x)
    got = block_means_kernel(x, real_lengths(order), order.block)
    want = block_means(x, order)  # CPU tensors: the einsum path
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
