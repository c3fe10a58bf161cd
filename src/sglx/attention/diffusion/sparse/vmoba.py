"""vmoba_attn: VMoBA (mixture of block attention for video diffusion, KwaiVGI/VMoBA) on sglx's block-sparse kernel.

Layers cycle through three chunk shapes (after the first `first_full_layer` layers, which run dense):
`temporal_layer` layers with temporal chunks (`temporal_chunk_size` whole frames), then `spatial_layer` layers
with spatial chunks (all frames of an h x w patch, `spatial_chunk_size`), then `st_layer` layers with
spatio-temporal chunks (a t x h x w box, `st_chunk_size`), then again. The first `first_full_step` steps run
dense. Tokens move into chunk order (a chunk's tokens contiguous, row-major inside it, each chunk padded to
whole kernel blocks; edge chunks of a grid that does not divide by the chunk are smaller, so any grid works).

Selection, as upstream `moba_attn_varlen`, with one adaptation to block-sparse kernels: it is made per
(batch row, head, query block of 16 tokens on CPU, 16-64 on CUDA, inside one chunk) from the block's
mean query instead of per query token. Every query block scores every chunk by `mean_q . mean_k(chunk)` and
always attends its own chunk; others are added by `moba_select_mode`:
- `threshold`: gates are min-max normalised within a group and the other entries, best first, are added until
  their normalised sum over the group's total reaches `moba_threshold` minus the own entries' share (the entry
  that reaches it included; upstream's rule; 1.0 keeps everything: dense). `moba_threshold_type` picks the
  group: `query_head` one query block and head (over chunks), `block` one chunk (over heads and query blocks),
  `head_global` one head (over query blocks and chunks), `overall` the whole batch row;
- `topk`: own entries first, then the best gates: k chunks per query block and head (`query_head`), k x query
  blocks per head (`head_global`) or k x heads x query blocks per batch row (`overall`); k = the layer type's
  `*_topk`. Groups never span batch rows (upstream's varlen batch would mix CFG rows under `overall`).

Unset chunk sizes and top-k (the seed gives no default) take FastVideo's published VMoBA config for
Wan2.1-T2V-1.3B (temporal 2 frames / top-3, spatial 3x4 / top-20, spatio-temporal 4x6x4 / top-15), each chunk
dimension cut to the grid; a chunk size the user set that is larger than the grid is an error. Joint text
tokens attend and are attended fully. Calls without step metadata run dense.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import check_qkv
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout, cdiv
from sglx.attention.diffusion.sparse.mask_lists import layout_from_mask
from sglx.attention.diffusion.sparse.sparse_backend import SparseDiTBackend, validated
from sglx.attention.diffusion.sparse.tile_order import Grid, TileOrder, tile_order
from sglx.attention.diffusion.sparse.tiled import (
    block_means,
    from_order,
    on_device,
    pooling_dtype,
    real_slots,
    to_order,
)
from sglx.errors import ConfigError

NAME = "vmoba_attn"
ChunkKind = Literal["temporal", "spatial", "st"]
SELECT_MODES = ("threshold", "topk")
THRESHOLD_TYPES = ("query_head", "block", "overall", "head_global")
# FastVideo's fastvideo/configs/backend/vmoba/wan_1.3B_77_480_832.json: the fallback for unset chunk sizes/top-k.
FALLBACK_CHUNKS: dict[str, tuple[int, ...]] = {"temporal": (2,), "spatial": (3, 4), "st": (4, 6, 4)}
FALLBACK_TOPK = {"temporal": 3, "spatial": 20, "st": 15}
EPS = 1e-6


@dataclass(frozen=True)
class VMoBAConfig:
    temporal_chunk_size: int | None = None
    temporal_topk: int | None = None
    spatial_chunk_size: tuple[int, ...] | None = None
    spatial_topk: int | None = None
    st_chunk_size: tuple[int, ...] | None = None
    st_topk: int | None = None
    moba_select_mode: str = "threshold"
    moba_threshold: float = 0.25
    moba_threshold_type: str = "query_head"
    first_full_step: int = 12
    first_full_layer: int = 0
    temporal_layer: int = 1
    spatial_layer: int = 1
    st_layer: int = 1

    def __post_init__(self) -> None:
        for key, dims in (("temporal_chunk_size", 1), ("spatial_chunk_size", 2), ("st_chunk_size", 3)):
            value = getattr(self, key)
            if value is None:
                continue
            sizes = (value,) if isinstance(value, int) else tuple(value)
            if len(sizes) != dims or min(sizes) < 1:
                what = "a positive number of frames" if dims == 1 else f"{dims} positive sizes"
                shape = "" if dims == 1 else " (H, W)" if dims == 2 else " (T, H, W)"
                raise ConfigError(f"{NAME} {key} must be {what}{shape}; got {value}", key)
        for key in ("temporal_topk", "spatial_topk", "st_topk"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{NAME} {key} must be >= 1 (chunks kept per query, its own included); got "
                                  f"{value}", key)
        if self.moba_select_mode not in SELECT_MODES:
            raise ConfigError(f"{NAME} moba_select_mode {self.moba_select_mode!r} is not one of "
                              f"{', '.join(SELECT_MODES)}", "moba_select_mode")
        if not 0.0 < self.moba_threshold <= 1.0:
            raise ConfigError(f"{NAME} moba_threshold must be in (0, 1] (1.0 keeps every chunk); got "
                              f"{self.moba_threshold}", "moba_threshold")
        if self.moba_threshold_type not in THRESHOLD_TYPES:
            raise ConfigError(f"{NAME} moba_threshold_type {self.moba_threshold_type!r} is not one of "
                              f"{', '.join(THRESHOLD_TYPES)}", "moba_threshold_type")
        if self.moba_select_mode == "topk" and self.moba_threshold_type == "block":
            raise ConfigError(f"{NAME} moba_select_mode topk takes moba_threshold_type query_head, head_global or "
                              "overall (upstream has no top-k per block)", "moba_threshold_type")
        for key in ("first_full_step", "first_full_layer", "temporal_layer", "spatial_layer", "st_layer"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{NAME} {key} must be >= 0; got {getattr(self, key)}", key)
        if self.cycle == 0:
            raise ConfigError(f"{NAME} needs at least one chunk layer: temporal_layer + spatial_layer + st_layer "
                              "is 0", "temporal_layer")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None) -> VMoBAConfig:
        return cls(**validated(NAME, config))

    @property
    def cycle(self) -> int:
        return self.temporal_layer + self.spatial_layer + self.st_layer

    def kind_of_layer(self, layer: int) -> ChunkKind | None:
        """The chunk type of DiT layer `layer`; None for the first `first_full_layer` (dense) layers."""
        if layer < self.first_full_layer:
            return None
        slot = (layer - self.first_full_layer) % self.cycle
        if slot < self.temporal_layer:
            return "temporal"
        return "spatial" if slot < self.temporal_layer + self.spatial_layer else "st"

    def chunk_box(self, kind: ChunkKind, grid: Grid) -> Grid:
        """The chunk as a (t, h, w) box of the grid; a user's size larger than the grid is an error."""
        key = f"{kind}_chunk_size"
        given = getattr(self, key)
        sizes = FALLBACK_CHUNKS[kind] if given is None else ((given,) if isinstance(given, int) else tuple(given))
        dims = {"temporal": (0,), "spatial": (1, 2), "st": (0, 1, 2)}[kind]
        box = list(grid)
        for size, dim in zip(sizes, dims):
            if given is not None and size > grid[dim]:
                raise ConfigError(f"{NAME} {key} {list(sizes)} does not fit the latent grid (T, H, W) = {grid}: "
                                  f"{'THW'[dim]} is {grid[dim]}; use at most {[grid[d] for d in dims]}", key)
            box[dim] = min(size, grid[dim])
        return (box[0], box[1], box[2])

    def topk(self, kind: ChunkKind) -> int:
        value = getattr(self, f"{kind}_topk")
        return FALLBACK_TOPK[kind] if value is None else value


def chunk_block(volume: int, device: torch.device) -> int:
    """Kernel block for chunks of `volume` tokens: 16 on CPU (fine selection on tiny grids); on CUDA 64 when it pads
    a chunk by at most a third more than the smallest padding would, else the largest of 32/16 within 1/16.

    Why a third: 64-token blocks run the block-sparse kernel on 64x64 tiles with TMA loads, about 3x faster per unit
    of work than 32-token blocks on the H100 (session 12, Wan 480p: the spatial layer's 64-token blocks 2.58 ms at
    16.9% of dense work, the spatio-temporal layer's 32-token blocks 8.0 ms at 17.0%), so VMoBA's default 4x6x4 =
    96-token spatio-temporal chunks padded to 128 still come out ahead."""
    if device.type != "cuda":
        return 16
    padded = {b: cdiv(volume, b) * b for b in (64, 32, 16)}
    best = min(padded.values())
    if padded[64] * 3 <= best * 4:
        return 64
    return next(b for b in (32, 16) if padded[b] * 16 <= best * 17)


@functools.lru_cache(maxsize=64)
def chunk_order(grid: Grid, box: Grid, text_tokens: int, text_prefix: bool, block: int) -> TileOrder:
    return tile_order(grid, box, text_tokens, text_prefix, block)


@dataclass(frozen=True)
class ChunkTables:
    """What a chunk order says about its blocks, built once per (order, device) so a call reads nothing back
    from the GPU: `tile` chunk of each block (-1: text), `text` its text blocks, `video` the latent block ids,
    `block_counts` real tokens per block, `chunk_counts` per chunk, `own_hot` [nb, C] each latent block's own
    chunk, `key_column` [nb] the column of a key block in [chosen chunks..., text] (text: C)."""

    chunks: int
    latent_blocks: int
    tile: torch.Tensor
    text: torch.Tensor
    video: torch.Tensor
    block_counts: torch.Tensor
    chunk_counts: torch.Tensor
    own_hot: torch.Tensor
    key_column: torch.Tensor


@functools.lru_cache(maxsize=64)
def chunk_tables(order: TileOrder, device: torch.device, dtype: torch.dtype) -> ChunkTables:
    tile = order.block_tile  # CPU
    text = tile < 0
    video = torch.nonzero(~text).squeeze(1)
    chunks = int(tile.max()) + 1 if video.numel() else 0
    counts = real_slots(order).sum(1).to(dtype)  # [nb]
    per_chunk = counts.new_zeros(chunks).index_add_(0, tile[video], counts[video])
    own_hot = torch.zeros(tile.numel(), chunks, dtype=torch.bool)
    own_hot[video, tile[video]] = True
    key_column = torch.where(text, chunks, tile)
    return ChunkTables(chunks, int(video.numel()), *(t.to(device) for t in (
        tile, text, video, counts, per_chunk, own_hot, key_column)))


def chunk_means(k_ordered: torch.Tensor, order: TileOrder, heads: int) -> torch.Tensor:
    """Mean key of every chunk's real tokens: [B, slots, Hkv, D] in chunk order -> [B, H, chunks, D]."""
    tables = chunk_tables(order, k_ordered.device, pooling_dtype(k_ordered))
    sums = block_means(k_ordered, order, heads) * tables.block_counts[None, None, :, None]
    out = sums.new_zeros(sums.shape[0], sums.shape[1], tables.chunks, sums.shape[3])
    out.index_add_(2, tables.tile[tables.video], sums.index_select(2, tables.video))
    return out / tables.chunk_counts[None, None, :, None]


# How candidates are grouped for normalisation and the cumulative threshold (upstream's threshold_type), as the
# dims of gate [B, H, N, C] (batch row, head, query block, chunk) that one group spans.
GROUP_DIMS = {"query_head": (3,), "block": (1, 2), "overall": (1, 2, 3), "head_global": (2, 3)}


def _grouped(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, list[int], list[int]]:
    """x [B, H, N, C] -> [groups, candidates] with `dims` as the candidate axis, and how to undo it."""
    rest = [d for d in range(4) if d not in dims]
    perm = rest + list(dims)
    moved = x.permute(perm)
    return moved.reshape(-1, math.prod(x.shape[d] for d in dims)), perm, list(moved.shape)


def _ungrouped(x: torch.Tensor, perm: list[int], shape: list[int]) -> torch.Tensor:
    return x.reshape(shape).permute([perm.index(d) for d in range(4)])


def select_threshold(gate: torch.Tensor, own_hot: torch.Tensor, valid: torch.Tensor, threshold: float,
                     threshold_type: str = "query_head") -> torch.Tensor:
    """Upstream's threshold rule: in each group (see GROUP_DIMS) gates are min-max normalised over the valid
    entries; the own-chunk entries count first, the others are added best first until their normalised sum over
    the group's total reaches `threshold` (the entry that reaches it included; none reaching it: all).

    gate, own_hot, valid: [B, H, N, C] -> bool [B, H, N, C] (own entries always kept, invalid never)."""
    if threshold >= 1.0:
        return valid.clone()
    g, perm, shape = _grouped(gate, GROUP_DIMS[threshold_type])
    own, _, _ = _grouped(own_hot & valid, GROUP_DIMS[threshold_type])
    ok, _, _ = _grouped(valid, GROUP_DIMS[threshold_type])
    lo = g.masked_fill(~ok, float("inf")).amin(-1, keepdim=True)
    hi = g.masked_fill(~ok, float("-inf")).amax(-1, keepdim=True)
    denom = hi - lo
    denom = torch.where((denom <= EPS) | ~torch.isfinite(denom), torch.ones_like(denom), denom)
    norm = ((g - lo) / denom).masked_fill(~ok, 0.0)
    total = norm.sum(-1, keepdim=True)
    remain = (threshold - (norm * own).sum(-1, keepdim=True) / (total + EPS)).clamp(min=0.0)
    ranked, order = norm.masked_fill(own, 0.0).sort(-1, descending=True)
    reached = ranked.cumsum(-1) / (total + EPS) >= remain
    cutoff = torch.where(reached.any(-1, keepdim=True), reached.float().argmax(-1, keepdim=True), g.shape[-1] - 1)
    keep = torch.arange(g.shape[-1], device=gate.device) <= cutoff
    picked = torch.zeros_like(keep).scatter_(-1, order, keep)
    return _ungrouped((picked & ok) | own, perm, shape)


def select_topk(gate: torch.Tensor, own_hot: torch.Tensor, valid: torch.Tensor, topk: int,
                threshold_type: str = "query_head", latent_rows: int | None = None) -> torch.Tensor:
    """Upstream's top-k rule: own-chunk entries first, then the best gates; query_head keeps k chunks per query
    block and head, head_global k x (query blocks) entries per head, overall k x heads x (query blocks) per
    batch row. -> bool [B, H, N, C]. `latent_rows`: the valid query blocks (read from `valid` when None)."""
    if threshold_type == "block":
        raise ConfigError(f"{NAME} moba_select_mode topk takes moba_threshold_type query_head, head_global or "
                          "overall (upstream has no top-k per block)", "moba_threshold_type")
    dims = GROUP_DIMS[threshold_type]
    rows = int(valid[0, 0, :, 0].sum()) if latent_rows is None else latent_rows  # valid (latent) query blocks
    per_group = {"query_head": 1, "head_global": rows, "overall": rows * gate.shape[1]}[threshold_type]
    g, perm, shape = _grouped(gate.masked_fill(own_hot, float("inf")).masked_fill(~valid, float("-inf")), dims)
    ok, _, _ = _grouped(valid, dims)
    picked = g.topk(min(topk * per_group, g.shape[-1]), dim=-1).indices
    chosen = torch.zeros_like(ok).scatter_(-1, picked, True) & ok
    return _ungrouped(chosen, perm, shape)


@dataclass(frozen=True)
class VMoBAPlan:
    order: TileOrder
    layout: BlockSparseLayout
    chunks: torch.Tensor  # bool [B, H, nb, C]: chunks each query block attends (text rows meaningless)


def vmoba_plan(q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, cfg: VMoBAConfig, kind: ChunkKind,
               block: int | None = None) -> VMoBAPlan:
    """Chunk order, per-query-block chunk choice and the block layout of one VMoBA layer."""
    box = cfg.chunk_box(kind, meta.grid)
    block = block or chunk_block(box[0] * box[1] * box[2], q.device)
    order = chunk_order(meta.grid, box, meta.text_tokens, meta.text_position != "suffix", block)
    return plan_ordered(to_order(q, order), to_order(k, order), order, cfg, kind)


def plan_ordered(qs: torch.Tensor, ks: torch.Tensor, order: TileOrder, cfg: VMoBAConfig, kind: ChunkKind
                 ) -> VMoBAPlan:
    """The plan from q and k already in chunk order [B, slots, H, D]. Reads nothing back from the device."""
    tables = chunk_tables(order, qs.device, pooling_dtype(qs))
    qb = block_means(qs, order)  # [B, H, nb, D]
    kc = chunk_means(ks, order, qs.shape[2])  # [B, H, C, D]
    gate = torch.einsum("bhnd,bhcd->bhnc", qb.double(), kc.double())
    text = tables.text
    own_hot = tables.own_hot[None, None]
    valid = (~text)[None, None, :, None].expand(gate.shape)
    if cfg.moba_select_mode == "topk":
        chosen = select_topk(gate, own_hot, valid, cfg.topk(kind), cfg.moba_threshold_type, tables.latent_blocks)
    else:
        chosen = select_threshold(gate, own_hot, valid, cfg.moba_threshold, cfg.moba_threshold_type)
    # a text column every query block keeps, text query blocks keeping everything: one gather makes the mask
    columns = F.pad(chosen, (0, 1), value=True) | text[None, None, :, None]
    mask = columns.index_select(-1, tables.key_column)
    lengths = None if order.k_lengths is None else on_device(order.k_lengths, qs.device)
    layout = layout_from_mask(mask, order.block, order.block, order.slots, lengths, width=order.num_blocks)
    return VMoBAPlan(order, layout, chosen)


class VMoBABackend(SparseDiTBackend):
    """VMoBA: dense for the first steps/layers, then temporal/spatial/spatio-temporal chunk layers in turn."""

    name = NAME

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        self.vmoba = VMoBAConfig.from_mapping(config)

    def layer_kind(self, meta: DiTAttnMetadata | None, layer: int) -> ChunkKind | None:
        """The chunk type this call runs; None when it runs dense (no metadata, a full step or layer)."""
        if meta is None or meta.step_index < self.vmoba.first_full_step:
            return None
        return self.vmoba.kind_of_layer(layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        kind = self.layer_kind(meta, layer)
        if kind is None or meta is None:
            return self.forward_dense(q, k, v, scale=scale)
        check_qkv(q, k, v)
        self.check_sequence(q, k, meta)
        cfg = self.vmoba
        box = cfg.chunk_box(kind, meta.grid)  # checks the user's chunk sizes against the grid
        if cfg.moba_threshold >= 1.0 and cfg.moba_select_mode == "threshold":
            return self.forward_dense(q, k, v, scale=scale)  # every chunk kept: exactly dense
        order = chunk_order(meta.grid, box, meta.text_tokens, meta.text_position != "suffix",
                            chunk_block(box[0] * box[1] * box[2], q.device))
        qs, ks, vs = (to_order(t, order) for t in (q, k, v))
        plan = plan_ordered(qs, ks, order, cfg, kind)
        return from_order(self.run(qs, ks, vs, plan.layout, scale), plan.order)


__all__ = ["VMoBABackend", "VMoBAConfig", "select_threshold", "select_topk", "vmoba_plan"]
