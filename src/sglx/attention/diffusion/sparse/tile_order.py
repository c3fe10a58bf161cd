"""Token order of tile-based sparse attention: latent tokens regrouped tile by tile, each tile padded to whole blocks.

STA's mask is a function of tiles, so a block-sparse kernel is exact only when no key block straddles two
tiles. Tokens are therefore moved into tile order (row-major over tiles, row-major (t, h, w) inside a tile)
and each tile is padded to a multiple of the kernel block; edge tiles of a grid that does not divide by the
tile are smaller and padded more. Padding slots are never attended: they sit at the end of their blocks and
`k_lengths` cuts them off. Joint text tokens keep their place (before or after the video) in blocks of their
own. One `TileOrder` per (grid, tile, text, block) is built once and cached.

`pack_partial` (VSA's cubes) pads nothing inside the video: tiles of a whole number of blocks come first, in tile
order, and the tokens of the edge tiles follow, concatenated in tile order, so every video block but the last is
full (neighbouring edge tiles share a block). A grid that does not divide by the tile then costs no padded work,
and without joint text the order is a pure permutation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.layout import cdiv

Grid = tuple[int, int, int]


@dataclass(frozen=True, eq=False)  # cached and used as a cache key: identity, not tensor equality
class TileOrder:
    """Where every token goes in the tile-ordered, padded sequence and what every block holds (CPU tensors)."""

    grid: Grid
    tile: Grid
    text_tokens: int
    text_prefix: bool
    block: int
    gather: torch.Tensor  # int64 [slots]: source token of each slot (pads repeat token 0, masked as keys)
    scatter: torch.Tensor  # int64 [seq]: slot of each source token
    q_map: torch.Tensor  # int32 [slots]: source token of each slot, -1 for padding (the kernel's fused gather)
    block_tile: torch.Tensor  # int64 [num_blocks]: tile id of each block, -1 for text blocks
    k_lengths: torch.Tensor | None  # int32 [num_blocks]: real tokens per block (None: no padding)
    identity: bool  # the tile order is the input order: no gather needed

    @property
    def slots(self) -> int:
        return int(self.gather.numel())

    @property
    def num_blocks(self) -> int:
        return cdiv(self.slots, self.block)

    @property
    def tiles_per_dim(self) -> Grid:
        return tuple(cdiv(g, t) for g, t in zip(self.grid, self.tile))  # type: ignore[return-value]


def _tile_ids_and_local(grid: Grid, tile: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per latent token (row-major t, h, w): its tile id, its index inside its tile's real box, and per tile the
    number of real tokens (edge tiles hold fewer)."""
    (gt, gh, gw), (tt, th, tw) = grid, tile
    nt, nh, nw = cdiv(gt, tt), cdiv(gh, th), cdiv(gw, tw)
    t, h, w = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
    t, h, w = t.reshape(-1), h.reshape(-1), w.reshape(-1)
    tile_id = (t // tt) * nh * nw + (h // th) * nw + (w // tw)
    box_h = torch.clamp(gh - (h // th) * th, max=th)  # real rows/cols of this token's tile
    box_w = torch.clamp(gw - (w // tw) * tw, max=tw)
    local = ((t % tt) * box_h + (h % th)) * box_w + (w % tw)
    sizes = torch.bincount(tile_id, minlength=nt * nh * nw)
    return tile_id, local, sizes


def _tile_starts(sizes: torch.Tensor, block: int, pack_partial: bool, text_after: bool
                 ) -> tuple[torch.Tensor, int]:
    """(first slot of every tile relative to the video's start, video slots). Padded: every tile rounded up to
    whole blocks. Packed: whole-block tiles first, then the other tiles back to back, the end rounded up to a
    block only when text follows."""
    if not pack_partial:
        padded = (sizes + block - 1) // block * block
        return torch.cumsum(padded, 0) - padded, int(padded.sum())
    whole = sizes % block == 0
    starts = torch.empty_like(sizes)
    for group, base in ((whole, 0), (~whole, int(sizes[whole].sum()))):
        part = sizes[group]
        starts[group] = base + torch.cumsum(part, 0) - part
    total = int(sizes.sum())
    return starts, cdiv(total, block) * block if text_after else total


@functools.lru_cache(maxsize=64)
def tile_order(grid: Grid, tile: Grid, text_tokens: int = 0, text_prefix: bool = True,
               block: int = 128, pack_partial: bool = False) -> TileOrder:
    """The tile-ordered sequence for a (T, H, W) latent grid plus `text_tokens` before (prefix) or after it."""
    tile = tuple(min(t, g) for t, g in zip(tile, grid))  # type: ignore[assignment]
    tile_id, local, sizes = _tile_ids_and_local(grid, tile)
    text_slots = cdiv(text_tokens, block) * block
    video_base = text_slots if text_prefix else 0
    starts, video_slots = _tile_starts(sizes, block, pack_partial, text_tokens > 0 and not text_prefix)
    tile_start = video_base + starts
    slots = video_slots + text_slots if text_tokens else video_slots
    text_base = 0 if text_prefix else video_slots
    image_start = text_tokens if text_prefix else 0
    seq = sizes.sum().item() + text_tokens

    scatter = torch.empty(seq, dtype=torch.int64)
    scatter[image_start:image_start + tile_id.numel()] = tile_start[tile_id] + local
    text_pos = torch.arange(text_tokens) + (0 if text_prefix else tile_id.numel())
    scatter[text_pos] = text_base + torch.arange(text_tokens)
    gather = torch.zeros(slots, dtype=torch.int64)
    gather[scatter] = torch.arange(seq)
    real = torch.zeros(slots, dtype=torch.int32)
    real[scatter] = 1
    q_map = torch.full((slots,), -1, dtype=torch.int32)
    q_map[scatter] = torch.arange(seq, dtype=torch.int32)

    nb = cdiv(slots, block)
    slot_tile = torch.full((nb * block,), -1, dtype=torch.int64)  # every video block starts with a real token
    slot_tile[scatter[image_start:image_start + tile_id.numel()]] = tile_id
    block_tile = slot_tile[::block].clone()  # the tile of each video block's first token, -1 for text blocks
    lengths = torch.nn.functional.pad(real, (0, nb * block - slots)).view(nb, block).sum(1, dtype=torch.int32)
    full = bool((lengths[:-1] == block).all()) and slots == seq
    identity = slots == seq and bool(torch.equal(scatter, torch.arange(seq)))
    return TileOrder(grid, tile, text_tokens, text_prefix, block, gather, scatter, q_map, block_tile,
                     None if full else lengths, identity)


def whole_step_order(order: TileOrder, meta: DiTAttnMetadata, hidden: torch.Tensor) -> TileOrder | None:
    """`order`, if a DiT may keep its hidden states [B, S, C] in it for a whole forward (sglx.diffusion.step_order):
    no joint text, the whole sequence, and a pure permutation (no padding slots) that moves some token."""
    if meta.text_tokens or hidden.shape[1] != meta.seq_len:
        return None
    return order if order.slots == meta.seq_len and not order.identity else None


_STEP_ORDER: ContextVar[TileOrder | None] = ContextVar("sglx_step_tile_order", default=None)


def step_tile_order() -> TileOrder | None:
    """The tile order the DiT's hidden states are already in for this forward (sglx.diffusion.step_order), if
    any: attention inputs then arrive in that order and outputs stay in it."""
    return _STEP_ORDER.get()


@contextlib.contextmanager
def tokens_in_tile_order(order: TileOrder | None) -> Iterator[None]:
    token = _STEP_ORDER.set(order)
    try:
        yield
    finally:
        _STEP_ORDER.reset(token)

