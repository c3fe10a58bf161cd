"""Route choice for block-sparse calls, and the FA4 route's block-sparse tensors checked with a stand-in kernel."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from sglx.attention.diffusion.sparse import fa4_route
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.reference import masked_attention
from sglx.attention.diffusion.sparse.routes import ENV, pick_route, run_block_sparse


class StandInTensors(NamedTuple):  # FA4's BlockSparseTensorsTorch fields we fill
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    block_size: tuple[int, int]


def stand_in_fa4(q, k, v, softmax_scale=None, causal=False, block_sparse_tensors=None):
    """Dense attention under FA4's block lists, processing each row's full blocks from the last listed, which
    is the only one whose sequence tail FA4 masks (a tail block listed elsewhere would read past the end)."""
    t = block_sparse_tensors
    assert not causal and int(t.mask_block_cnt.sum()) == 0
    bq, bk = t.block_size
    seq = q.shape[1]
    nk = -(-seq // bk)
    cnt, idx = t.full_block_cnt, t.full_block_idx
    for row in range(cnt.shape[-1]):
        for b in range(cnt.shape[0]):
            for h in range(cnt.shape[1]):
                listed = idx[b, h, row, : cnt[b, h, row]].tolist()
                assert nk - 1 not in listed[:-1], "the partial tail block must be listed last"
    mask = torch.zeros(*cnt.shape, nk + 1, dtype=torch.bool)
    valid = torch.arange(idx.shape[-1]) < cnt.unsqueeze(-1)
    mask.scatter_(-1, torch.where(valid, idx.long(), nk), True)
    layout = BlockSparseLayout.from_block_mask(mask[..., :nk], bq, bk, seq)
    return masked_attention(q, k, v, layout, softmax_scale), None


def test_cpu_calls_take_the_reference_and_env_forces_a_route(monkeypatch):
    q = torch.randn(1, 32, 1, 64)
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, 16, 32)
    assert pick_route(q, layout)[0] == "reference"
    monkeypatch.setenv(ENV, "triton")
    assert pick_route(q, layout) == ("triton", f"{ENV}=triton")
    monkeypatch.setenv(ENV, "nope")
    with pytest.raises(ValueError, match="choose one of fa4, triton, reference"):
        pick_route(q, layout)


def test_fa4_route_lists_match_the_layout(monkeypatch):
    monkeypatch.setattr(fa4_route, "fa4_modules", lambda: (stand_in_fa4, StandInTensors))
    torch.manual_seed(0)
    seq = 128 * 3 + 50  # partial tail block
    q, k, v = (torch.randn(1, seq, 2, 64, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(1, 2, 4, 4) < 0.6
    mask[..., 3] = True  # every row lists the tail block, among others
    # descending lists (as top-k selections give): the route must move the tail block last
    layout = BlockSparseLayout.from_block_mask(mask, 128, 128, seq)
    desc = torch.sort(layout.kv_indices, dim=-1, descending=True).values
    layout = BlockSparseLayout(128, 128, seq, desc.to(torch.int32), layout.kv_counts)
    got = run_block_sparse(q, k, v, layout, 0.2, route="fa4")
    assert torch.allclose(got, masked_attention(q, k, v, layout, 0.2))
