"""Route choice for block-sparse calls, and the FA4 route's block-sparse tensors checked with a stand-in kernel."""

from __future__ import annotations

from types import SimpleNamespace
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


@pytest.mark.parametrize(("major", "blocks", "fits", "refused"), [
    (9, (128, 128), False, None),
    (10, (128, 128), False, None),
    (9, (64, 64), True, None),       # VSA's cubes, VMoBA's 64-token blocks
    (9, (128, 64), True, None),
    (9, (192, 112), True, None),
    (9, (64, 64), False, "need flash-attn-4 >= 4.0.0b36"),
    (10, (64, 64), True, "takes 128x128 blocks here"),   # Blackwell's small tiles never ran here
    (9, (32, 64), True, "takes 128x128 blocks here"),    # SM90 query tiles are multiples of 64
    (9, (64, 256), True, "takes 128x128 blocks here"),   # key tiles at most 128 on SM90
    (9, (64, 72), True, "takes 128x128 blocks here"),    # key tiles in steps of 16
])
def test_fa4_block_shapes_by_architecture(monkeypatch, major, blocks, fits, refused):
    monkeypatch.setattr(fa4_route, "fits_small_blocks", lambda: fits)
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), *blocks, 2 * blocks[0])
    why = fa4_route._block_shape_refused(major, layout)
    assert why is None if refused is None else refused in why


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [(128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded-keys"])
def test_fa4_route_matches_float64(blocks, padded):
    """FA4's block-sparse path at every block shape the route sends it (a partial tail block, padded keys)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.manual_seed(0)
    bq, bk = blocks
    seq = 7 * 128 + 40
    q, k, v = (torch.randn(1, seq, h, 128, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    nq, nk = -(-seq // bq), -(-seq // bk)
    mask = torch.rand(1, 4, nq, nk, device="cuda") < 0.3
    mask[..., 0] = True
    lengths = None
    if padded:
        lengths = torch.randint(1, bk + 1, (nk,), device="cuda", dtype=torch.int32)
        lengths[-1] = min(int(lengths[-1]), seq - (nk - 1) * bk)
    layout = BlockSparseLayout.from_block_mask(mask, bq, bk, seq, lengths)
    why = fa4_route.fa4_supports(q, layout)
    if why is not None:
        pytest.skip(why)
    got = run_block_sparse(q, k, v, layout, route="fa4")
    want = masked_attention(q.double(), k.double(), v.double(), layout)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= 2e-2, err


def test_auto_route_keeps_small_blocks_on_triton(monkeypatch):
    """FA4 runs 64x64 blocks on SM90 but measured no faster: auto keeps them on Triton and says so; 128x128 go
    to FA4; the env still forces FA4."""
    from sglx.attention.diffusion.sparse import routes

    q = SimpleNamespace(device=torch.device("cuda"))  # pick_route reads only the device (FA4 support stubbed)
    monkeypatch.setattr(routes, "fa4_supports", lambda q, layout: None)
    small = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool), 64, 64, 256)
    big = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 128, 128, 256)
    route, why = pick_route(q, small)
    assert route == "triton" and "64x64 blocks" in why and f"{ENV}=fa4" in why
    assert pick_route(q, big)[0] == "fa4"
    monkeypatch.setenv(ENV, "fa4")
    assert pick_route(q, small)[0] == "fa4"
