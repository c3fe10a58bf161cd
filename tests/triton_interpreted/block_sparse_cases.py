"""Interpreted cases (TRITON_INTERPRET=1): the block-sparse kernel against the masked reference in float64."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_block_sparse_attention.py"

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout, cdiv  # noqa: E402
from sglx.attention.diffusion.sparse.reference import masked_attention  # noqa: E402
from sglx.attention.kernels.block_sparse_attention import BlockSparseConfig, block_sparse_attention  # noqa: E402


def random_layout(b: int, h: int, seq: int, qb: int, kb: int, *, density: float = 0.5, empty_row: bool = True,
                  text_blocks: int = 0, lengths: bool = False, seed: int = 0) -> BlockSparseLayout:
    """Random key-block lists; text blocks (the first ones) attend and are attended by every block."""
    g = torch.Generator().manual_seed(seed)
    nq, nk = cdiv(seq, qb), cdiv(seq, kb)
    mask = torch.rand(b, h, nq, nk, generator=g) < density
    if text_blocks:
        mask[:, :, :, :text_blocks] = True
        mask[:, :, : cdiv(text_blocks * kb, qb)] = True
    if empty_row:
        mask[..., -1, :] = False
    k_lengths = None
    if lengths:  # every key block keeps a random number of real keys at its start (at least one)
        k_lengths = torch.randint(1, kb + 1, (nk,), generator=g, dtype=torch.int32)
        k_lengths[-1] = min(int(k_lengths[-1]), seq - (nk - 1) * kb)
    return BlockSparseLayout.from_block_mask(mask, qb, kb, seq, k_lengths)


def _check(q, k, v, layout, scale=None, tol=None, config=BlockSparseConfig()):
    want = masked_attention(q.double(), k.double(), v.double(), layout, scale)
    got = block_sparse_attention(q, k, v, layout, scale, config=config)
    assert got.shape == q.shape and got.dtype == q.dtype
    err = (got.double() - want).abs().max().item()
    limit = tol if tol is not None else 2e-2 * want.abs().max().item()
    assert err <= limit, f"max abs error {err} > {limit}"


@pytest.mark.parametrize(("b", "hq", "hkv", "lb", "lh", "seq", "qb", "kb", "dim", "text", "lengths"), [
    (1, 2, 2, 1, 1, 64, 16, 16, 64, 0, False),      # broadcast batch and head dims
    (2, 4, 2, 2, 4, 75, 32, 16, 64, 0, False),      # GQA, per-row per-head lists, partial last block
    (1, 3, 1, 1, 3, 50, 16, 32, 128, 1, False),     # MQA, text block, partial last key block, D128
    (2, 2, 1, 1, 2, 96, 32, 32, 64, 0, True),       # padded key blocks (k_lengths), sub-tiles of 16
])
def test_matches_masked_reference_float32(b, hq, hkv, lb, lh, seq, qb, kb, dim, text, lengths):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, seq, h, dim) for h in (hq, hkv, hkv))
    layout = random_layout(lb, lh, seq, qb, kb, text_blocks=text, lengths=lengths)
    config = BlockSparseConfig(block_n=16) if lengths else BlockSparseConfig()
    _check(q, k, v, layout, scale=0.3, tol=1e-4, config=config)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize(("b", "hq", "hkv", "seq", "lengths"), [(2, 4, 2, 75, False), (1, 2, 1, 96, True)])
def test_tma_variant_matches_masked_reference_float32(b, hq, hkv, seq, lengths, head_major):
    """K/V through TMA descriptors, over [B * S, Hkv * D] rows or, for head-major views (a [B, H, S, D] buffer
    seen as [B, S, H, D], as SVG2's permutations leave them), over [B * Hkv * S, D] rows read in place: rows past the
    tensor read as zeros, rows of the next batch row or head (partial last block) and padding keys are masked."""
    from sglx.attention.kernels.block_sparse_attention import _head_major

    torch.manual_seed(2)
    q, k, v = (torch.randn(b, seq, h, 64) for h in (hq, hkv, hkv))
    if head_major:
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert hkv == 1 or (_head_major(k) and _head_major(v))  # one head: both layouts are one buffer
    layout = random_layout(b, hq, seq, 32, 32, lengths=lengths)
    _check(q, k, v, layout, scale=0.3, tol=1e-4, config=BlockSparseConfig(32, 16, tma=True))


@pytest.mark.parametrize("dtype", [torch.float16])  # bf16 tl.dot is wrong under the interpreter: GPU tests cover it
def test_half_precision_within_2e2(dtype):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 48, 2, 64).to(dtype) for _ in range(3))
    _check(q, k, v, random_layout(1, 2, 48, 16, 16, seed=3, lengths=True))


def test_empty_layout_gives_zeros():
    q = torch.randn(1, 32, 1, 64)
    mask = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    out = block_sparse_attention(q, q, q, BlockSparseLayout.from_block_mask(mask, 16, 16, 32))
    assert torch.equal(out, torch.zeros_like(out))


def test_q_map_reads_queries_and_writes_outputs_in_input_order():
    """k/v in a permuted, padded layout order; q and out in input order through q_map (-1 = padding slot)."""
    torch.manual_seed(2)
    seq, slots = 40, 64
    q, k, v = (torch.randn(1, seq, 2, 64) for _ in range(3))
    perm = torch.randperm(seq)
    gather = torch.full((slots,), -1, dtype=torch.int64)
    where = torch.cat([torch.arange(0, 14), torch.arange(16, 30), torch.arange(32, 44)])  # 3 blocks of 16 padded
    gather[where] = perm
    lengths = torch.tensor([14, 14, 12, 0], dtype=torch.int32)
    mask = torch.rand(1, 2, 4, 4) < 0.7
    mask[..., 0] = True
    layout = BlockSparseLayout.from_block_mask(mask, 16, 16, slots, lengths)
    kp, vp, qp = (t[:, gather.clamp(min=0)] for t in (k, v, q))
    want_slots = masked_attention(qp.double(), kp.double(), vp.double(), layout, 0.25)
    got = block_sparse_attention(q, kp, vp, layout, 0.25, q_map=gather.to(torch.int32))
    want = torch.zeros_like(want_slots[:, :seq])
    want[:, perm] = want_slots[:, where]
    assert got.shape == q.shape
    assert (got.double() - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("route", ["triton", "reference"])
def test_sta_backend_through_the_kernel_in_input_order(tmp_path, monkeypatch, route):
    """sliding_tile_attn with the Triton route forced (k/v gathered, q/out through q_map) vs token-level STA."""
    from sglx.attention.diffusion.metadata import DiTAttnMetadata
    from sglx.attention.diffusion.sparse.routes import ENV
    from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend, sta_tile_mask
    from sglx.attention.diffusion.sparse.sta_strategy import write_uniform_strategy

    monkeypatch.setenv(ENV, route)
    path = write_uniform_strategy(tmp_path / "s.json", 1, 2, (1, 1, 3))
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(path), "skip_time_steps": 0},
                                          tile=(1, 2, 2), block=16)
    meta = DiTAttnMetadata(grid=(2, 3, 7), num_heads=2, head_dim=64, text_tokens=5, text_position="prefix")
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, meta.seq_len, 2, 64) for _ in range(3))
    got = backend.forward(q, k, v, meta=meta, layer=0)
    assert backend.route == route
    t, h, w = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(7), indexing="ij")
    tiles = (t // 1 * 2 * 4 + h // 2 * 4 + w // 2).reshape(-1)  # tile ids on a 2x2x4 grid of tiles
    video = sta_tile_mask((2, 2, 4), ((1, 1, 3),))[0][tiles][:, tiles]
    allowed = torch.ones(meta.seq_len, meta.seq_len, dtype=torch.bool)
    allowed[5:, 5:] = video
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 8
    want = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v.double())
    assert (got.double() - want).abs().max().item() <= 1e-4
