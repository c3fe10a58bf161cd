"""Upstream fastvideo-kernel at the mask an sglx sparse backend chose: same-run anchors for `sglx bench diffusion`.

Where `fastvideo_kernel` imports (a CUDA GPU with the package installed), its STA and VSA run on the tokens in
the sglx backend's order, which is FastVideo's order on the canvases upstream takes (row-major tiles/cubes,
row-major inside). STA: upstream accepts only its three canvases (30x48x80, 36x48x48, 18x48x80), 6x8x8 tiles, no
joint text. VSA: 4x4x4 cubes; upstream pools over zero padding, so padding slots are zeroed first, and a zero
compress gate leaves its fine branch alone, which is what sglx's backend computes (its selection may differ
where bf16 cube scores nearly tie). Anything else raises, and the bench shows the reason in the anchor's row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.bench.sparse_plan import PlanView, from_slots, to_slots

STA_CANVASES = ("30x48x80", "36x48x48", "18x48x80")
UPSTREAM = ("sliding_tile_attn", "video_sparse_attn")  # the sglx backends fastvideo-kernel has a kernel for

Upstream = tuple[Callable[[], torch.Tensor], Callable[[], object], str]  # (input-order call, kernel call, detail)


def upstream_call(name: str, view: PlanView, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: DiTAttnMetadata, layer: int, scale: float) -> Upstream:
    """(call returning [B, S, H, D] in input order, the kernel call alone, what ran) for backend `name`."""
    if name == "sliding_tile_attn":
        return _sta(view, backend, q, k, v, meta, layer, scale)
    if name == "video_sparse_attn":
        return _vsa(view, backend, q, k, v)
    raise RuntimeError(f"fastvideo-kernel has no {name} kernel to compare with")


def _heads_first(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return to_slots(x, index).transpose(1, 2).contiguous()


def sta_kernel(args: list[torch.Tensor], windows: list[list[int]], canvas: str) -> tuple[Callable[[], torch.Tensor],
                                                                                          str]:
    """(call, what runs) of fastvideo_kernel's STA on q, k, v [B, H, S, D] in tile order (6x8x8 tiles, no text).

    Its Triton autotuner compiles 72 configs; only the 16 of H100-sized tiles are kept (a bench run's time is
    limited). Raises ImportError where fastvideo_kernel is missing."""
    from fastvideo_kernel import sliding_tile_attention  # type: ignore[import-not-found]

    if canvas not in STA_CANVASES:
        raise RuntimeError(f"upstream STA takes only {', '.join(STA_CANVASES)}; this canvas is {canvas}")
    tuned = None
    try:
        from fastvideo_kernel.triton_kernels import st_attn_triton  # type: ignore[import-not-found]

        tuner = st_attn_triton.triton_sta_kernel
        tuner.configs = [c for c in tuner.configs if c.kwargs["BLOCK_Q"] in (64, 128)
                         and c.kwargs["BLOCK_KV"] in (64, 128) and c.num_stages in (2, 3)]
        tuned = len(tuner.configs)
    except Exception:  # noqa: BLE001 - another layout of the package: its own autotuning as shipped
        pass

    def call() -> torch.Tensor:
        return sliding_tile_attention(*args, windows, 0, False, canvas)

    ops = importlib.import_module("fastvideo_kernel.ops")
    compiled = getattr(ops, "sta_fwd", None) is not None
    path = "compiled sta_fwd (ThunderKittens)" if compiled else f"Triton, {tuned} autotune configs"
    return call, path


def vsa_kernel(args: list[torch.Tensor], order: Any, sparsity: float) -> tuple[Callable[[], torch.Tensor], str]:
    """(call, what runs) of fastvideo_kernel's VSA on q, k, v [B, H, slots, D] in sglx's cube order (64-token
    blocks: whole 4x4x4 cubes, then the edge cubes packed; any padding at a block's end). Upstream pools over zero
    padding, so padding slots are zeroed here; a zero compress gate leaves its fine branch alone (sglx's output)."""
    from fastvideo_kernel import video_sparse_attn  # type: ignore[import-not-found]

    from sglx.attention.diffusion.sparse.tiled import real_slots
    from sglx.attention.diffusion.sparse.video_sparse import compute_topk

    real = real_slots(order).reshape(-1).to(args[0].device)
    sizes = real.view(order.num_blocks, -1).sum(1).long()
    args = [(t * real[None, None, :, None].to(t.dtype)).contiguous() for t in args]
    gate = torch.zeros_like(args[0])
    topk = compute_topk(sparsity, order.num_blocks)

    def call() -> torch.Tensor:
        return video_sparse_attn(*args, sizes, sizes, topk, block_size=(4, 4, 4), compress_attn_weight=gate)

    bsa = importlib.import_module("fastvideo_kernel.block_sparse_attn")
    sm90 = bsa._get_sm90_ops()[0] is not None and bsa._is_sm90()
    return call, f"top-{topk} cubes, {'compiled sm90 (ThunderKittens)' if sm90 else 'Triton'}"


def _sta(view: PlanView, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DiTAttnMetadata,
         layer: int, scale: float) -> Upstream:
    canvas = "x".join(map(str, meta.grid))
    if meta.text_tokens or tuple(backend.tile) != (6, 8, 8):
        raise RuntimeError(f"upstream STA takes 6x8x8 tiles and no joint text; this call has tile "
                           f"{'x'.join(map(str, backend.tile))} and {meta.text_tokens} text tokens")
    if abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        raise RuntimeError("upstream STA has no softmax scale argument (it uses 1/sqrt(head_dim))")
    if backend.strategy is None:
        from sglx.attention.diffusion.sparse.sliding_tile import DEFAULT_WINDOW
        from sglx.attention.diffusion.sparse.sta_search import clamp_window

        windows = [list(clamp_window(DEFAULT_WINDOW, view.order.tiles_per_dim))] * q.shape[2]
    else:
        windows = [list(w) for w in backend.strategy.layer_windows(meta.step_index, layer, q.shape[2])]
    kernel, path = sta_kernel([_heads_first(t, view.q_index) for t in (q, k, v)], windows, canvas)

    def in_input_order() -> torch.Tensor:
        return from_slots(kernel().transpose(1, 2), view.q_slot)

    return in_input_order, kernel, f"fastvideo_kernel.sliding_tile_attention ({path}), tile-ordered tokens"


def _vsa(view: PlanView, backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Upstream:
    kernel, path = vsa_kernel([_heads_first(t, view.q_index) for t in (q, k, v)], view.order, backend.vsa.sparsity)

    def in_input_order() -> torch.Tensor:
        return from_slots(kernel().transpose(1, 2), view.q_slot)

    return in_input_order, kernel, f"fastvideo_kernel.video_sparse_attn ({path}), cube-ordered tokens"


__all__ = ["STA_CANVASES", "UPSTREAM", "sta_kernel", "upstream_call", "vsa_kernel"]
