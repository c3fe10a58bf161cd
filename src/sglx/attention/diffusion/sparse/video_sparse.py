"""video_sparse_attn: Video Sparse Attention (VSA, FastVideo) on sglx's block-sparse kernel, any (T, H, W) grid.

The latent grid is cut into 4x4x4 cubes; tokens move into cube order, one cube = one 64-token block. On a grid
that does not divide by 4 the edge cubes are smaller: their tokens follow the whole cubes back to back (tile_order's
`pack_partial`), so neighbouring edge cubes share a block and every block but the last is full. (Padding each
edge cube to a block of its own made 12.5% of the cubes cost 15.4% of dense attention at 18x48x80 and 18.6% at
Wan's 21x30x52; FastVideo accepts only grids that divide, where both orders are the same.) Without joint text
the order is a pure permutation, so a Wan DiT keeps its tokens in it for a whole step (`step_order`).
Coarse stage: queries and keys are mean-pooled per cube (real tokens only), cube-to-cube scores
`q_c . k_c * scale` pick, for every (batch row, head, query cube), the top-k key cubes, k = ceil((1 - sparsity)
* cubes) clamped to [1, cubes] (FastVideo's `compute_topk`). Fine stage: block-sparse attention of every query
block over its selected blocks (one block = one cube, or packed edge cubes). Joint text tokens sit in blocks of
their own that attend and are attended by every block.

Combination, as FastVideo's `video_sparse_attn`: `out = out_fine + gate_compress * out_coarse`, where
`out_coarse` is dense attention over the pooled cubes broadcast to each cube's tokens and `gate_compress` is
a learned per-token projection (`to_gate_compress`) that only VSA-trained checkpoints carry. FastVideo's
loader zero-initialises a missing gate, so on a stock checkpoint (every model sglx runs today) the coarse
branch adds nothing and the output is the fine branch alone; `video_sparse_attention(..., gate_compress=g)`
computes the gated sum for a caller that has a gate. Hence sparsity 0.0 is exactly dense attention, and the
backend runs it as such (SDPA) whenever every cube keeps every cube.

Calls without step metadata (plain module calls, `sglx doctor --check`) and cross-attention run dense.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import check_qkv
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.routes import run_block_sparse
from sglx.attention.diffusion.sparse.sparse_backend import SparseDiTBackend, validated
from sglx.attention.diffusion.sparse.tile_order import TileOrder, step_tile_order, tile_order, whole_step_order
from sglx.attention.diffusion.sparse.tiled import block_means, from_order, on_device, to_order
from sglx.attention.kernels.topk_rows import kernel_serves as topk_kernel_serves
from sglx.attention.kernels.topk_rows import topk_ascending
from sglx.errors import ConfigError

NAME = "video_sparse_attn"
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockSparseLayout, float], torch.Tensor]
CUBE = (4, 4, 4)
CUBE_TOKENS = 64  # one cube = one kernel block


def compute_topk(sparsity: float, cubes: int) -> int:
    """Cubes each query cube keeps: (1 - sparsity) of them rounded up, at least 1 (FastVideo's rule)."""
    return max(1, min(math.ceil((1.0 - sparsity) * cubes), cubes))


@dataclass(frozen=True)
class VSAConfig:
    sparsity: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"{NAME} sparsity must be in [0, 1) (the share of cubes skipped; 0.0 is dense); got "
                              f"{self.sparsity}", "sparsity")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None) -> VSAConfig:
        values = validated(NAME, config)
        return cls(sparsity=values["sparsity"])


def cube_order(meta: DiTAttnMetadata) -> TileOrder:
    return tile_order(meta.grid, CUBE, meta.text_tokens, meta.text_position != "suffix", CUBE_TOKENS,
                      pack_partial=True)


@functools.lru_cache(maxsize=64)
def _block_kinds(order: TileOrder) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bool [nb]: video block, int64 ids of the video blocks, int64 ids of the text blocks), on the CPU and cached
    per order, so building a layout never waits on the GPU for them."""
    video = order.block_tile >= 0
    return video, torch.nonzero(video).squeeze(1), torch.nonzero(~video).squeeze(1)


def vsa_layout(scores: torch.Tensor, order: TileOrder, sparsity: float) -> BlockSparseLayout:
    """Key-block lists from cube scores [B, H, nb, nb]: every cube row lists its top-k cubes and the text blocks
    (ascending), every text row lists all blocks. Built directly from the top-k indices: no [nb x nb] sort."""
    device = scores.device
    video, cubes, text_ids = (on_device(t, device) for t in _block_kinds(order))
    topk = compute_topk(sparsity, int(cubes.numel()))
    b, h, nb, _ = scores.shape
    if topk_kernel_serves(scores):  # one Triton program a row: the picked ids come out ascending
        picked = topk_ascending(scores, topk, video)
    else:  # unsorted top-k, then one int32 sort of the picked block ids
        picked = cubes.to(torch.int32)[scores.index_select(-1, cubes).topk(topk, dim=-1, sorted=False).indices]
        picked = picked.sort(-1).values
    rows = picked
    counts = torch.full((b, h, nb), picked.shape[-1] + text_ids.numel(), dtype=torch.int32, device=device)
    if text_ids.numel():  # cube rows also list the text blocks; text rows list every block
        rows = torch.cat([picked, text_ids.to(torch.int32).expand(b, h, nb, -1)], -1).sort(-1).values
        rows = F.pad(rows, (0, nb - rows.shape[-1]), value=-1)
        rows[:, :, text_ids] = torch.arange(nb, device=device, dtype=torch.int32)
        counts[:, :, text_ids] = nb
    lengths = None if order.k_lengths is None else on_device(order.k_lengths, device)
    return BlockSparseLayout(order.block, order.block, order.slots, rows.to(torch.int32).contiguous(), counts,
                             lengths)


@dataclass(frozen=True)
class VSAPlan:
    """One layer's VSA in cube order: the layout of the fine stage and the coarse scores it came from."""

    order: TileOrder
    layout: BlockSparseLayout
    scores: torch.Tensor  # [B, H, nb, nb] coarse cube scores (scaled)


def plan_ordered(qs: torch.Tensor, ks: torch.Tensor, order: TileOrder, sparsity: float, scale: float) -> VSAPlan:
    """Pool q and k (already in cube order [B, slots, H, D]) per cube; pick the cubes every query cube attends."""
    qc = block_means(qs, order) * scale  # scaled before the product: [nb, D] multiplies, not [nb, nb]
    kc = block_means(ks, order, heads=qs.shape[2])
    scores = torch.einsum("bhnd,bhmd->bhnm", qc, kc)
    return VSAPlan(order, vsa_layout(scores, order, sparsity), scores)


def vsa_plan(q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, sparsity: float, scale: float) -> VSAPlan:
    """The plan for q and k in input order [B, S, H, D]."""
    order = cube_order(meta)
    return plan_ordered(to_order(q, order), to_order(k, order), order, sparsity, scale)


def keeps_everything(meta: DiTAttnMetadata, sparsity: float) -> bool:
    """Whether every query cube keeps every cube: VSA is then exactly dense attention."""
    order = cube_order(meta)
    cubes = int((order.block_tile >= 0).sum())
    return compute_topk(sparsity, cubes) == cubes


def video_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DiTAttnMetadata,
                           sparsity: float, scale: float | None = None,
                           gate_compress: torch.Tensor | None = None, runner: Runner = run_block_sparse
                           ) -> torch.Tensor:
    """VSA over one step's sequence, q [B, S, Hq, D], k/v [B, S, Hkv, D] in input order -> [B, S, Hq, D].

    `gate_compress` [B, S, Hq, D] (a VSA-trained model's to_gate_compress output) adds the gated coarse branch;
    None means a zero gate: the fine branch alone."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    order = cube_order(meta)
    ordered = step_tile_order() is order  # the DiT keeps its tokens in cube order for the whole step
    qs, ks, vs = (q, k, v) if ordered else (to_order(t, order) for t in (q, k, v))
    plan = plan_ordered(qs, ks, order, sparsity, scale)
    out = runner(qs, ks, vs, plan.layout, scale)
    out = out if ordered else from_order(out, plan.order)
    if gate_compress is None:
        return out
    vc = block_means(vs, plan.order, heads=q.shape[2])  # [B, H, nb, D]
    coarse = torch.einsum("bhnm,bhmd->bhnd", plan.scores.softmax(-1), vc)
    slots = torch.arange(q.shape[1], device=q.device) if ordered else on_device(plan.order.scatter, q.device)
    coarse = coarse.index_select(2, slots // plan.order.block).transpose(1, 2)  # [B, S, H, D]
    return out + (gate_compress.to(coarse.dtype) * coarse).to(out.dtype)


class VideoSparseAttentionBackend(SparseDiTBackend):
    """VSA with the config's sparsity on every self-attention call of every step and layer."""

    name = NAME

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.vsa = VSAConfig.from_mapping(config)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        if meta is None:
            return self.forward_dense(q, k, v, scale=scale)
        check_qkv(q, k, v)
        self.check_sequence(q, k, meta)
        if keeps_everything(meta, self.vsa.sparsity):  # sparsity 0, or a single cube: the same as dense
            return self.forward_dense(q, k, v, scale=scale)
        return video_sparse_attention(q, k, v, meta, self.vsa.sparsity, scale, runner=self.run)

    def step_order(self, meta: DiTAttnMetadata, hidden: torch.Tensor) -> TileOrder | None:
        """The cube order a DiT may keep its hidden states in for a whole forward (sglx.diffusion.step_order):
        only a pure permutation (no joint text) and only when the step runs sparse."""
        if keeps_everything(meta, self.vsa.sparsity):
            return None
        return whole_step_order(cube_order(meta), meta, hidden)


__all__ = ["VSAConfig", "VideoSparseAttentionBackend", "compute_topk", "video_sparse_attention", "vsa_plan"]
