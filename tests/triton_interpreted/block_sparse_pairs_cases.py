"""Interpreted cases (TRITON_INTERPRET=1): the paired-query-block kernel against float64 masked attention under the
same layout, and its three lists per pair against the layout's rows."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_block_sparse_attention.py"

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout  # noqa: E402
from sglx.attention.diffusion.sparse.reference import masked_attention  # noqa: E402
from sglx.attention.kernels.block_sparse_pairs import block_sparse_pairs, pair_lists  # noqa: E402


def _layout(b, h, seq, density, seed):
    g = torch.Generator().manual_seed(seed)
    nb = -(-seq // 64)
    mask = torch.rand(b, h, nb, nb, generator=g) < density
    mask[..., 0] = True
    return BlockSparseLayout.from_block_mask(mask, 64, 64, seq)


def test_pair_lists_split_each_pair_into_only_a_only_b_and_both():
    layout = _layout(1, 2, 5 * 64, 0.5, 0)  # five query blocks: the last pairs with an empty one
    lists, counts = pair_lists(layout)
    mask = layout.block_mask()
    assert lists.shape[:4] == (1, 2, 3, 3)
    for h in range(2):
        for p in range(3):
            a = set(torch.nonzero(mask[0, h, 2 * p]).flatten().tolist())
            b = set(torch.nonzero(mask[0, h, 2 * p + 1]).flatten().tolist()) if 2 * p + 1 < 5 else set()
            for kind, want in enumerate((a - b, b - a, a & b)):
                got = lists[0, h, p, kind, : counts[0, h, p, kind]].tolist()
                assert got == sorted(want)
                assert (lists[0, h, p, kind, counts[0, h, p, kind]:] == -1).all()


@pytest.mark.parametrize(("b", "hq", "hkv", "seq", "dim"), [(1, 2, 2, 5 * 64, 64), (2, 4, 2, 3 * 64 + 17, 64),
                                                            (1, 1, 1, 4 * 64, 128)])
def test_matches_float64(b, hq, hkv, seq, dim):
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(b, seq, h, dim, generator=g) for h in (hq, hkv, hkv))
    layout = _layout(b, hq, seq, 0.45, seq)
    got = block_sparse_pairs(q, k, v, layout, 0.3)
    want = masked_attention(q.double(), k.double(), v.double(), layout, 0.3)
    assert (got.double() - want).abs().max().item() <= 1e-4
