"""SVG2 and VMoBA planning stays on the device: the reads back to the host a sparse call makes are counted here
(on a GPU each one drains the launch queue; the H100 run of session 4 lost most of SVG2's call to planning), and
the no-read code paths give what the reading ones gave."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.kmeans import CHECK_EVERY, kmeans
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.mask_lists import layout_from_mask
from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend
from sglx.attention.diffusion.sparse.vmoba import VMoBABackend, VMoBAConfig, vmoba_plan

HOST_READS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "_unique2", "bincount"}


class HostReads(TorchDispatchMode):
    """Counts the aten ops that need a device value on the host (.item(), int(), bool(), nonzero, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _qkv(meta: DiTAttnMetadata, hkv: int | None = None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    hq, d = meta.num_heads, meta.head_dim
    centres = torch.randn(6, d, generator=gen, dtype=torch.float64) * 2
    def tokens(h: int) -> torch.Tensor:
        which = torch.randint(0, 6, (1, meta.seq_len, h), generator=gen)
        return centres[which] + torch.randn(1, meta.seq_len, h, d, generator=gen, dtype=torch.float64)
    return tokens(hq), tokens(hkv or hq), torch.randn(1, meta.seq_len, hkv or hq, d, generator=gen,
                                                      dtype=torch.float64)


def _meta(text: int = 0, step: int = 40) -> DiTAttnMetadata:
    return DiTAttnMetadata(grid=(4, 6, 8), num_heads=4, head_dim=16, text_tokens=text,
                           text_position="prefix" if text else "none", step_index=step, num_steps=50, num_layers=30)


def test_layout_from_mask_with_a_static_width_lists_the_same_blocks():
    gen = torch.Generator().manual_seed(6)
    for density in (0.0, 0.4, 1.0):
        mask = torch.rand(2, 3, 9, 9, generator=gen) < density
        want = BlockSparseLayout.from_block_mask(mask, 16, 16, 140)
        for width in (9, 12):
            with HostReads() as spy:
                got = layout_from_mask(mask, 16, 16, 140, width=width)
            assert spy.reads == []
            cut = want.kv_indices.shape[-1]
            assert got.kv_indices.shape[-1] == width and torch.equal(got.kv_counts, want.kv_counts)
            assert torch.equal(got.kv_indices[..., :cut], want.kv_indices)
            assert bool((got.kv_indices[..., cut:] == -1).all())


def test_warm_kmeans_reads_nothing_and_frozen_centroids_equal_stopping():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 200, 8, generator=gen, dtype=torch.float64)
    start = kmeans(x, 12, 4)
    with HostReads() as spy:
        warm = kmeans(x, 12, 2, init=start.centroids)
    assert spy.reads == []
    # a tolerance every first shift meets: converged after iteration 1, later iterations change nothing
    one = kmeans(x, 12, 1)
    frozen = kmeans(x, 12, CHECK_EVERY - 1, tol=1e9)
    assert torch.equal(frozen.labels, one.labels) and torch.equal(frozen.centroids, one.centroids)
    moving = kmeans(x, 12, CHECK_EVERY - 1, tol=0.0)  # never converges: every iteration moves on
    assert not torch.equal(moving.centroids, one.centroids)
    assert torch.equal(warm.sizes.sum(-1), torch.full((3,), 200))
    # a long first clustering looks every CHECK_EVERY iterations (not after the last: nothing is left to skip)
    with HostReads() as spy:
        kmeans(x, 12, 3 * CHECK_EVERY, tol=0.0)
    assert len(spy.reads) == 2


def test_vmoba_plan_reads_nothing_back():
    meta = _meta(text=7)
    q, k, _ = _qkv(meta, hkv=2)
    for cfg in (VMoBAConfig(), VMoBAConfig(moba_select_mode="topk", moba_threshold_type="head_global")):
        for kind in ("temporal", "spatial", "st"):
            vmoba_plan(q, k, meta, cfg, kind, block=16)  # builds the cached per-order tables
            with HostReads() as spy:
                plan = vmoba_plan(q, k, meta, cfg, kind, block=16)
            assert spy.reads == [], (cfg, kind)
            assert plan.layout.kv_indices.shape[-1] == plan.layout.num_k_blocks
            assert 0.0 < plan.layout.density() <= 1.0
    backend = VMoBABackend({"first_full_step": 0})
    backend.forward(q, k, _qkv(meta, hkv=2)[2], meta=meta, layer=2)
    with HostReads() as spy:
        backend.forward(q, k, _qkv(meta, hkv=2)[2], meta=meta, layer=2)
    # the whole call but the masked reference (CPU's kernel), which reads nothing either
    assert spy.reads == []


def test_svg2_warm_call_reads_one_value_back():
    meta = _meta(text=5)
    q, k, v = _qkv(meta)
    backend = SparseVideoGen2Backend({"num_q_centroids": 8, "num_k_centroids": 16, "top_p_kmeans": 0.6})
    backend.forward(q, k, v, meta=meta, layer=5)
    with HostReads() as spy:
        out = backend.forward(q, k, v, meta=meta.at_step(41), layer=5)  # warm: 2 k-means iterations
    assert spy.reads == ["_local_scalar_dense"]  # the permuted query length
    assert backend.last_plan is not None and out.shape == q.shape


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_kmeans_assignment_under_the_interpreter():
    from triton_interpreted.launch import run_interpreted

    run_interpreted("kmeans_assign_cases.py")
