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


def stand_in_fa4(q, k, v, softmax_scale=None, causal=False, block_sparse_tensors=None, mask_mod=None,
                 aux_tensors=None):
    """Dense attention under FA4's block lists: full blocks unmasked, mask blocks through the key validity the
    mask_mod reads (aux_tensors[0]); FA4 masks the sequence tail only in the first block it processes (the last
    listed), so a partial tail block listed elsewhere is an error."""
    t = block_sparse_tensors
    assert not causal
    assert (mask_mod is None) == (aux_tensors is None) == (int(t.mask_block_cnt.sum()) == 0)
    bq, bk = t.block_size
    seq = q.shape[1]
    nk = -(-seq // bk)
    mask = torch.zeros(*t.full_block_cnt.shape, nk + 1, dtype=torch.bool)
    for cnt, idx in ((t.full_block_cnt, t.full_block_idx), (t.mask_block_cnt, t.mask_block_idx)):
        for row in range(cnt.shape[-1]):
            for b in range(cnt.shape[0]):
                for h in range(cnt.shape[1]):
                    listed = idx[b, h, row, : cnt[b, h, row]].tolist()
                    assert nk - 1 not in listed[:-1], "the partial tail block must be listed last"
        valid = torch.arange(idx.shape[-1]) < cnt.unsqueeze(-1)
        mask.scatter_(-1, torch.where(valid, idx.long(), nk), True)
    lengths = None
    if aux_tensors is not None:  # validity per key slot -> real keys at the start of each block
        real = aux_tensors[0].view(-1, bk)
        assert torch.equal(real, torch.sort(real, dim=1, descending=True).values)
        lengths = real.sum(1, dtype=torch.int32)
    layout = BlockSparseLayout.from_block_mask(mask[..., :nk], bq, bk, seq, lengths)
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


def test_fa4_route_with_padded_key_blocks_uses_the_mask_lists(monkeypatch):
    monkeypatch.setattr(fa4_route, "fa4_modules", lambda: (stand_in_fa4, StandInTensors))
    monkeypatch.setattr(fa4_route, "padding_mask_mod", lambda: "mask_mod")
    torch.manual_seed(1)
    seq = 128 * 4
    q, k, v = (torch.randn(1, seq, 2, 64, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(1, 2, 4, 4) < 0.7
    lengths = torch.tensor([128, 40, 128, 1], dtype=torch.int32)
    layout = BlockSparseLayout.from_block_mask(mask, 128, 128, seq, lengths)
    got = run_block_sparse(q, k, v, layout, 0.3, route="fa4")
    assert torch.allclose(got, masked_attention(q, k, v, layout, 0.3))
    tensors, aux = fa4_route._fa4_tensors(layout)
    assert set(tensors.mask_block_idx[tensors.mask_block_idx >= 0].tolist()) <= {1, 3}
    assert set(tensors.full_block_idx[tensors.full_block_idx >= 0].tolist()) <= {0, 2}
