"""sliding_tile_attn: Sliding Tile Attention (STA) over the video latent grid, on sglx's block-sparse kernel.

The latent grid is cut into tiles (6x8x8 tokens, FastVideo's tile for Wan/Hunyuan-shaped latents); a query
tile attends the wt x wh x ww key tiles around it, the window sliding inside the grid (its centre clamped
half a window from the edges, as in FastVideo's STA). Windows come per (step, layer, head) from a mask
strategy file in FastVideo's JSON format; sta_mode STA_searching writes one (sta_search.py). Tokens are moved
into tile order (each tile padded to whole kernel blocks, padding never attended), attended block-sparsely,
and moved back. Joint text tokens attend and are attended by everything. The first `skip_time_steps` steps,
cross-attention and calls outside a pipeline step run dense. The kernel route (FA4 block-sparse, the Triton
kernel, or the plain-PyTorch masked reference off CUDA) is picked per call by routes.pick_route.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from sglx.attention.diffusion.base import DiffusionAttentionBackend, check_qkv
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.routes import pick_route, run_block_sparse
from sglx.attention.diffusion.sparse.sta_search import (
    DEFAULT_CANDIDATES,
    DEFAULT_TOLERANCE,
    SearchRecord,
    clamp_window,
    head_errors,
)
from sglx.attention.diffusion.sparse.sta_strategy import (
    MaskStrategy,
    Window,
    load_strategy,
    uniform_strategy,
    write_uniform_strategy,
)
from sglx.attention.diffusion.sparse.tile_order import (
    Grid,
    TileOrder,
    step_tile_order,
    tile_order,
    tokens_in_tile_order,
    whole_step_order,
)
from sglx.errors import ConfigError, SglxError

__all__ = ["SlidingTileAttentionBackend", "sta_layout", "sta_tile_mask", "uniform_strategy", "write_uniform_strategy"]

log = logging.getLogger("sglx.attention")

DEFAULT_TILE: Grid = (6, 8, 8)
DEFAULT_WINDOW: Window = (3, 3, 3)  # without a strategy file (programmatic use only; the CLI requires one)
MODES = ("STA_inference", "STA_searching")


def sta_tile_mask(tiles: Grid, windows: tuple[Window, ...]) -> torch.Tensor:
    """bool [heads, num_tiles, num_tiles]: query tile i attends key tile j under each head's window."""
    coords = tile_coords_for(tiles)  # [N, 3]
    win = torch.tensor(windows, dtype=torch.int64)  # [H, 3]
    half = win // 2
    n = torch.tensor(tiles, dtype=torch.int64)
    lo, hi = half, n - 1 - half
    centre = torch.minimum(torch.maximum(coords[None], lo[:, None]), hi[:, None])  # [H, N, 3] (torch.clamp order)
    near = (centre[:, :, None, :] - coords[None, None, :, :]).abs() <= half[:, None, None, :]
    return near.all(-1)


def tile_coords_for(tiles: Grid) -> torch.Tensor:
    nt, nh, nw = tiles
    ids = torch.arange(nt * nh * nw)
    return torch.stack([ids // (nh * nw), ids // nw % nh, ids % nw], 1)


def check_windows(windows: tuple[Window, ...], tiles: Grid, grid: Grid, where: str) -> None:
    for head, window in enumerate(windows):
        if any(w > n for w, n in zip(window, tiles)):
            raise ConfigError(f"STA window {list(window)} of {where} head {head} is larger than the grid: {grid} "
                              f"tokens are {list(tiles)} tiles; use windows of at most {list(tiles)}",
                              "mask_strategy_file_path")


@functools.lru_cache(maxsize=256)
def _cached_layout(order: TileOrder, windows: tuple[Window, ...], device: str) -> BlockSparseLayout:
    return sta_layout(order, windows, torch.device(device))


def sta_layout(order: TileOrder, windows: tuple[Window, ...], device: torch.device | str = "cpu"
               ) -> BlockSparseLayout:
    """The block-sparse layout of STA over a tile-ordered sequence: one row list per head (one shared row
    set when every head has the same window); text blocks attend and are attended by every block."""
    uniq = windows if len(set(windows)) > 1 else windows[:1]
    tile_mask = sta_tile_mask(order.tiles_per_dim, uniq)  # [H|1, N, N]
    bt = order.block_tile
    text = bt < 0
    safe = bt.clamp(min=0)
    blocks = tile_mask[:, safe][:, :, safe]  # [H|1, nb, nb]
    blocks = blocks | text[None, None, :] | text[None, :, None]
    layout = BlockSparseLayout.from_block_mask(blocks[None].to(device), order.block, order.block, order.slots,
                                               None if order.k_lengths is None else order.k_lengths.to(device))
    return layout


class SlidingTileAttentionBackend(DiffusionAttentionBackend):
    """STA with windows from a FastVideo mask strategy file; `tile` and `block` are fixed per instance."""

    name = "sliding_tile_attn"
    sparse = True
    default_tile: ClassVar[Grid] = DEFAULT_TILE  # FastVideo's; mask strategy windows count these tiles

    def __init__(self, config: Mapping[str, Any] | None = None, *, tile: Grid | None = None,
                 block: int | None = None) -> None:
        super().__init__(config)
        # The CLI requires the file (the registry's schema); programmatic callers (doctor --check, tests) may
        # leave it out and get DEFAULT_WINDOW for every layer and head, cut to the grid.
        path = self.config.get("mask_strategy_file_path")
        mode = self.config.get("sta_mode", "STA_inference")
        if mode not in MODES:
            raise ConfigError(f"sliding_tile_attn sta_mode {mode!r} is not supported; choose STA_inference (windows "
                              "from the file) or STA_searching (dense generation that writes the searched windows "
                              "to the file); STA_tuning is not implemented", "sta_mode")
        self.mode = mode
        self.skip_time_steps = int(self.config.get("skip_time_steps", 15))
        if self.skip_time_steps < 0:
            raise ConfigError(f"skip_time_steps must be >= 0; got {self.skip_time_steps}", "skip_time_steps")
        if mode == "STA_searching" and not path:
            raise ConfigError("sta_mode STA_searching needs mask_strategy_file_path: the searched windows are written "
                              "there", "mask_strategy_file_path")
        self.path = str(path or "")
        self.search: SearchRecord | None = SearchRecord() if mode == "STA_searching" else None
        self.candidates: tuple[Window, ...] = DEFAULT_CANDIDATES
        self.tolerance = DEFAULT_TOLERANCE
        self.strategy: MaskStrategy | None = load_strategy(path) if path and self.search is None else None
        self.tile = tile or self.default_tile
        self.block = block
        self.route: str | None = None  # the kernel the last sparse call ran (routes.pick_route), and why
        self.route_why = ""
        self.last_layout: BlockSparseLayout | None = None  # the last sparse call's layout (density reports)

    @property
    def last_density(self) -> float | None:
        """Share of block pairs the last sparse call computed (None before one)."""
        return None if self.last_layout is None else self.last_layout.density()

    def forward_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: float | None = None) -> torch.Tensor:
        check_qkv(q, k, v)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                meta: DiTAttnMetadata | None = None, layer: int = 0) -> torch.Tensor:
        if meta is None or meta.step_index < self.skip_time_steps:
            return self.forward_dense(q, k, v, scale=scale)
        check_qkv(q, k, v)
        if q.shape[1] != meta.seq_len or k.shape[1] != meta.seq_len:
            raise SglxError(f"sliding_tile_attn: sequence of {q.shape[1]} tokens, but the step's grid {meta.grid} "
                            f"and {meta.text_tokens} text tokens make {meta.seq_len}")
        if self.search is not None:
            return self._search(q, k, v, meta, layer, scale)
        if self.strategy is None:
            windows = (clamp_window(DEFAULT_WINDOW, self._tiles(meta, q)),) * q.shape[2]
        else:
            # under Ulysses q holds heads [head_offset, head_offset + H) of the layer
            first = meta.head_offset
            windows = self.strategy.layer_windows(meta.step_index, layer, first + q.shape[2])[first:]
        return self.attend(q, k, v, meta, windows, scale=scale, where=f"layer {layer}")

    def _search(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DiTAttnMetadata, layer: int,
                scale: float | None) -> torch.Tensor:
        """STA_searching: return dense attention; record each candidate window's per-head error against it and
        rewrite the strategy file (after the last layer of a step when the layer count is known)."""
        assert self.search is not None
        dense = self.forward_dense(q, k, v, scale=scale)
        tiles = self._tiles(meta, q)
        windows = list(dict.fromkeys(clamp_window(w, tiles) for w in self.candidates))
        for i, window in enumerate(windows):
            sparse = self.attend(q, k, v, meta, (window,) * q.shape[2], scale=scale, where=f"layer {layer}")
            self.search.add(meta.step_index, layer, window, head_errors(sparse, dense), i == 0)
        if meta.num_layers is None or layer == meta.num_layers - 1:
            self.search.write(self.path, self.tolerance)
        return dense

    def step_order(self, meta: DiTAttnMetadata, hidden: torch.Tensor) -> TileOrder | None:
        """The tile order a DiT may keep its hidden states in for a whole forward (sglx.diffusion.step_order):
        only a pure permutation (every tile a whole number of blocks, no joint text) and not while searching."""
        if self.search is not None:
            return None
        return whole_step_order(tile_order(meta.grid, self.tile, 0, True, self.block or _default_block(hidden)), meta,
                                hidden)

    def _tiles(self, meta: DiTAttnMetadata, q: torch.Tensor) -> Grid:
        return tile_order(meta.grid, self.tile, meta.text_tokens, meta.text_position != "suffix",
                          self.block or _default_block(q)).tiles_per_dim

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DiTAttnMetadata,
               windows: tuple[Window, ...], *, scale: float | None = None, where: str = "") -> torch.Tensor:
        """STA with the given per-head windows (the step/layer lookup done): tile order, kernel, input order."""
        order = tile_order(meta.grid, self.tile, meta.text_tokens, meta.text_position != "suffix",
                           self.block or _default_block(q))
        check_windows(windows, order.tiles_per_dim, meta.grid, where)
        layout = _cached_layout(order, windows, str(q.device))
        route, why = pick_route(q, layout)
        if route != self.route:  # shown once per change: which kernel STA runs and why
            log.info("sliding_tile_attn: block-sparse route %s (%s)", route, why)
        self.route, self.route_why = route, why
        self.last_layout = layout
        ahead = step_tile_order()
        if order.identity or ahead is order:  # tokens already in tile order (kept so for the whole step)
            return run_block_sparse(q, k, v, layout, scale, route)
        if ahead is not None:  # in another backend's order: back to input order first (not expected)
            q, k, v = (t.index_select(1, _on(ahead.scatter, q.device)) for t in (q, k, v))
            with tokens_in_tile_order(None):
                out = self.attend(q, k, v, meta, windows, scale=scale, where=where)
            return out.index_select(1, _on(ahead.gather, q.device))
        # Three gathers and one scatter on every route: the Triton kernel's q_map (q/out read and written in
        # input order) measured slower on H100 (11.28 vs 9.98 ms at 69,120 tokens, STA 85%).
        gather = _on(order.gather, q.device)
        q, k, v = (t.index_select(1, gather) for t in (q, k, v))
        out = run_block_sparse(q, k, v, layout, scale, route)
        return out.index_select(1, _on(order.scatter, q.device))


def _default_block(q: torch.Tensor) -> int:
    """Kernel-sized blocks on CUDA; small ones elsewhere, so tiny grids keep real sparsity on the reference."""
    return 128 if q.device.type == "cuda" else 16


@functools.lru_cache(maxsize=64)
def _device_copy(tensor: torch.Tensor, device: str) -> torch.Tensor:
    return tensor.to(device)  # keyed by the (cached) TileOrder's tensor object


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else _device_copy(tensor, str(device))
