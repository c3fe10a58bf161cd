"""What a sparse DiT backend's last call attended, as a bench can use it: its token permutation and block layout.

Every sglx sparse backend moves tokens into its own order (STA: tiles, VSA: 4x4x4 cubes, VMoBA: chunks, SVG2:
clusters per head) and runs a block-sparse layout over that order. A `PlanView` holds both, so the bench can
(1) check sampled rows of the backend's input-order output against float64 attention under exactly that mask,
and (2) run the same mask through another kernel (FlexAttention's block mask, upstream kernels) on the
permuted tokens. Built after the backend's call, from what it recorded (`last_layout`, SVG2's `last_plan`) and
its order (a pure function of the grid and the backend's settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout


@dataclass(frozen=True)
class PlanView:
    """Slots and layout of one sparse call. Index tensors are [B|1, L or S, H|1] int64 (broadcast over batch
    rows and heads when 1): `q_index`/`k_index` the source token of every slot, `q_slot`/`k_slot` the slot of
    every token; k tensors count key/value heads."""

    layout: BlockSparseLayout
    q_index: torch.Tensor
    q_slot: torch.Tensor
    k_index: torch.Tensor
    k_slot: torch.Tensor
    order: Any = None  # the TileOrder for STA/VSA/VMoBA (upstream kernels need it), None for SVG2

    @property
    def density(self) -> float:
        return self.layout.density()


def _tile_view(layout: BlockSparseLayout, order: Any, device: torch.device) -> PlanView:
    gather, scatter = order.gather.to(device)[None, :, None], order.scatter.to(device)[None, :, None]
    return PlanView(layout, gather, scatter, gather, scatter, order)


def plan_view(backend: Any, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, layer: int,
              scale: float) -> PlanView | None:
    """The plan of `backend`'s last `forward(q, k, v, meta=meta, layer=layer)`; None when that call ran dense."""
    layout = getattr(backend, "last_layout", None)
    if layout is None:
        return None
    name = backend.name
    if name == "sliding_tile_attn":
        from sglx.attention.diffusion.sparse.sliding_tile import _default_block
        from sglx.attention.diffusion.sparse.tile_order import tile_order

        order = tile_order(meta.grid, backend.tile, meta.text_tokens, meta.text_position != "suffix",
                           backend.block or _default_block(q))
        return _tile_view(layout, order, q.device)
    if name == "video_sparse_attn":
        from sglx.attention.diffusion.sparse.video_sparse import cube_order

        return _tile_view(layout, cube_order(meta), q.device)
    if name == "vmoba_attn":
        from sglx.attention.diffusion.sparse.vmoba import vmoba_plan

        plan = vmoba_plan(q, k, meta, backend.vmoba, backend.vmoba.kind_of_layer(layer))
        return _tile_view(layout, plan.order, q.device)
    if name == "sparse_video_gen_2_attn":
        p = backend.last_plan
        return PlanView(p.layout, p.q_index.long(), p.q_slot.long(), p.k_index.long(), p.k_slot.long())
    raise ValueError(f"{name}: no plan view (not one of sglx's block-sparse backends)")


def to_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] -> [B, L, H, D] in slot order (`index` [B|1, L, H|1] broadcast)."""
    b, _, h, d = x.shape
    full = index.expand(b, index.shape[1], h)
    return x.gather(1, full[..., None].expand(b, full.shape[1], h, d))


def from_slots(x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """[B, L, H, D] in slot order -> [B, S, H, D] in input order (`slot` [B|1, S, H|1])."""
    return to_slots(x, slot)


def rows_mask(view: PlanView, rows: torch.Tensor, batch: int, hq: int, hkv: int) -> torch.Tensor:
    """bool [B, Hq, len(rows), S]: the keys (input order) each sampled query token attends under the plan."""
    lay = view.layout
    blocks = lay.block_mask().to(rows.device)  # [B|1, H|1, nq, nk]
    blocks = blocks.expand(batch, hq, *blocks.shape[2:])
    q_slot = view.q_slot.expand(batch, -1, hq)[:, rows]  # [B, R, Hq]
    k_slot = view.k_slot.expand(batch, -1, hkv).repeat_interleave(hq // hkv, 2)  # [B, S, Hq]
    valid = lay.key_valid().to(rows.device)[k_slot]  # [B, S, Hq]
    qb = (q_slot // lay.q_block).permute(0, 2, 1)  # [B, Hq, R]
    kb = (k_slot // lay.k_block).permute(0, 2, 1)  # [B, Hq, S]
    per_row = blocks.gather(2, qb[..., None].expand(*qb.shape, blocks.shape[-1]))  # [B, Hq, R, nk]
    allowed = per_row.gather(3, kb[:, :, None, :].expand(*qb.shape, kb.shape[-1]))  # [B, Hq, R, S]
    return allowed & valid.permute(0, 2, 1)[:, :, None, :]


def masked_rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                          rows: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of query tokens `rows` under `allowed` [B, Hq, R, S] -> [B, R, Hq, D]."""
    hq, hkv = q.shape[2], k.shape[2]
    qd = q[:, rows].double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vd = v.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (probs @ vd).transpose(1, 2)


__all__ = ["PlanView", "from_slots", "masked_rows_reference", "plan_view", "rows_mask", "to_slots"]
