"""Keeping a Wan DiT's tokens in the attention backend's tile order for a whole forward: STA's reorder paid once.

STA attends in tile order. Moving q, k, v into it and the output back costs four gathers in every layer
(about 0.6 ms of 7 ms at 69,120 tokens on H100). Everything else in a Wan block works token by token (norms,
modulation, projections, FFN, the queries of cross-attention) and the rotary tables are per token, so the
hidden states and the rotary tables can move into tile order once before the first block and the hidden states
back once after the last; every self-attention then receives and returns tile order. Dense attention (warm-up
steps, cross-attention) gives the same result in any token order. Used only where the backend offers an order
that is a pure permutation (`step_order`: no padding slots, no joint text), the modulation is per sample (Wan2.2
TI2V's per-token timesteps keep the per-layer path) and the blocks are called as block(hidden, context, temb,
rotary) with the whole sequence (under sequence parallelism, sharding.py splits the rotary tables and the
tokens per rank, so the per-layer path is kept).
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.diffusion.metadata import current_metadata
from sglx.attention.diffusion.sparse.tile_order import TileOrder, tokens_in_tile_order


class _Step:
    """What one forward moved: the order and the rotary tables it moved (per forward, reset at its start)."""

    def __init__(self) -> None:
        self.order: TileOrder | None = None
        self.rotary_in: Any = None
        self.rotary: Any = None
        self.scope: Any = None


def _move(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(1, index.to(x.device))


def install_step_order(transformer: Any, backend: Any) -> bool:
    """Hooks on a WanTransformer3DModel's blocks that keep its tokens in `backend.step_order(meta, hidden)`
    between the first and the last block. Returns whether they were installed (the backend offers an order)."""
    blocks = getattr(transformer, "blocks", None)
    if not hasattr(backend, "step_order") or not blocks:
        return False
    step = _Step()

    def first(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        step.__init__()  # type: ignore[misc]
        meta = current_metadata()
        if meta is None or len(args) != 4 or not isinstance(args[3], tuple) or args[2].ndim != 3:
            return None
        hidden, context, temb, rotary = args
        if any(t.shape[1] != hidden.shape[1] for t in rotary):  # sequence parallel: rotary already split per rank
            return None
        order = backend.step_order(meta, hidden)
        if order is None:
            return None
        step.order, step.rotary_in = order, rotary
        step.rotary = tuple(_move(t, order.gather) for t in rotary)
        step.scope = tokens_in_tile_order(order)
        step.scope.__enter__()
        return _move(hidden, order.gather), context, temb, step.rotary

    def later(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if step.order is None or len(args) != 4 or args[3] is not step.rotary_in:
            return None
        return args[0], args[1], args[2], step.rotary

    def last(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        if step.order is None:
            return None
        order, scope = step.order, step.scope
        step.__init__()  # type: ignore[misc]
        scope.__exit__(None, None, None)
        return _move(output, order.scatter)

    blocks[0].register_forward_pre_hook(first)
    for block in blocks[1:]:
        block.register_forward_pre_hook(later)
    blocks[-1].register_forward_hook(last)
    forward = transformer.forward

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        finally:  # a forward that failed between the first and the last block leaves no order behind
            if step.scope is not None:
                step.scope.__exit__(None, None, None)
                step.__init__()  # type: ignore[misc]

    transformer.forward = guarded
    return True


__all__ = ["install_step_order"]
