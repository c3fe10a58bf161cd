"""`doctor --check` for the sparse DiT backends: a real sparse call with step metadata, against float64.

Run with `meta=None` a sparse backend is plain dense attention, which proves nothing about its masks or its
block-sparse kernel. Here each one gets a video grid with joint text (a prefix), GQA and a step past its
dense warm-up, three layers (VMoBA cycles its chunk shapes over them), and a config that is sparse on that
grid. Its output in input order is compared with float64 attention under the mask its own plan chose, moved
back to input order (STA: tile order; VSA: cube order; VMoBA: chunk order; SVG2: cluster order per head). A
call that ended up attending every block pair is reported as a failure: the check would not have exercised
the sparse path. On CUDA the grid is large enough for kernel-sized blocks (tiles of 6x8x8 on 128-token
blocks; 64-token cubes), on other devices small (the masked-reference route, 16-token blocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.registry import BackendSpec

SPARSE_BACKENDS = ("sliding_tile_attn", "video_sparse_attn", "vmoba_attn", "sparse_video_gen_2_attn")
LAYERS = 3
ROWS = 192  # sampled query rows on CUDA (every row elsewhere)


def _configs(cuda: bool) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """(config, constructor keywords) per backend: sparse on the check's grid from the first step on."""
    return {
        "sliding_tile_attn": ({"skip_time_steps": 0}, {} if cuda else {"tile": (2, 2, 2), "block": 16}),
        "video_sparse_attn": ({"sparsity": 0.75}, {}),
        "vmoba_attn": ({"first_full_step": 0, "moba_select_mode": "topk", "temporal_chunk_size": 2,
                        "temporal_topk": 2, "spatial_chunk_size": [4, 8] if cuda else [2, 3], "spatial_topk": 3,
                        "st_chunk_size": [2, 4, 8] if cuda else [2, 2, 3], "st_topk": 3}, {}),
        "sparse_video_gen_2_attn": ({"first_times_fp": 0.0, "first_layers_fp": 0.0, "num_q_centroids": 12,
                                     "num_k_centroids": 24, "top_p_kmeans": 0.7}, {}),
    }


def _input_order_mask(backend: Any, q: torch.Tensor, k: torch.Tensor, meta: DiTAttnMetadata, layer: int,
                      scale: float) -> torch.Tensor:
    """bool [B|1, H, S, S]: the mask the backend's plan for this call attends, in input order."""
    name = backend.name
    if name == "sliding_tile_attn":
        from sglx.attention.diffusion.sparse.sliding_tile import DEFAULT_WINDOW, _default_block, sta_layout
        from sglx.attention.diffusion.sparse.sta_search import clamp_window
        from sglx.attention.diffusion.sparse.tile_order import tile_order

        order = tile_order(meta.grid, backend.tile, meta.text_tokens, meta.text_position != "suffix",
                           backend.block or _default_block(q))
        windows = (clamp_window(DEFAULT_WINDOW, order.tiles_per_dim),) * q.shape[2]
        mask, slot = sta_layout(order, windows, q.device).token_mask(), order.scatter.to(q.device)
        return mask[:, :, slot][:, :, :, slot]
    if name in ("video_sparse_attn", "vmoba_attn"):
        if name == "video_sparse_attn":
            from sglx.attention.diffusion.sparse.video_sparse import vsa_plan

            plan = vsa_plan(q, k, meta, backend.vsa.sparsity, scale)
        else:
            from sglx.attention.diffusion.sparse.vmoba import vmoba_plan

            plan = vmoba_plan(q, k, meta, backend.vmoba, backend.vmoba.kind_of_layer(layer))
        mask, slot = plan.layout.token_mask(), plan.order.scatter.to(q.device)
        return mask[:, :, slot][:, :, :, slot]
    plan = backend.last_plan  # SVG2: per-head permutations of this call
    perm = plan.layout.token_mask()
    hq, hkv = q.shape[2], k.shape[2]
    q_slot = plan.q_slot.transpose(1, 2)  # [B, Hq, S]
    k_slot = plan.k_slot.transpose(1, 2).repeat_interleave(hq // hkv, 1)
    return torch.stack([torch.stack([perm[b, h][q_slot[b, h]][:, k_slot[b, h]] for h in range(hq)])
                        for b in range(q.shape[0])])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
               scale: float) -> torch.Tensor:
    """float64 masked attention of query rows `rows` -> [B, len(rows), H, D]."""
    hq, hkv = q.shape[2], k.shape[2]
    qd = q[:, rows].double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vd = v.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask[:, :, rows], float("-inf")).softmax(-1).nan_to_num(0.0)
    return (probs @ vd).transpose(1, 2)


def sparse_problem(spec: BackendSpec, device: torch.device, dtype: torch.dtype,
                   sync: Callable[[torch.device], None]) -> tuple[float, float, str]:
    """(max abs error vs float64, ms of the sparse calls, what ran) for one sparse backend."""
    cuda = device.type == "cuda"
    grid, text = ((12, 16, 40), 77) if cuda else ((6, 6, 12), 9)
    hq, hkv, dim = 4, 2, 128 if cuda else 64
    config, kwargs = _configs(cuda)[spec.name]
    backend = spec.load()(config, **kwargs)
    meta = DiTAttnMetadata(grid=grid, num_heads=hq, head_dim=dim, text_tokens=text, text_position="prefix",
                           step_index=1, num_steps=2, num_layers=LAYERS)
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(hq, 8, dim, generator=gen) * 2  # clustered q/k: structure data-dependent picks can find
    which = torch.randint(0, 8, (1, meta.seq_len, hq), generator=gen)
    q = (centres[torch.arange(hq), which] + torch.randn(1, meta.seq_len, hq, dim, generator=gen)).to(device, dtype)
    k = (centres[torch.arange(hkv), which[..., :hkv]] + torch.randn(1, meta.seq_len, hkv, dim, generator=gen))
    k = k.to(device, dtype)
    v = torch.randn(1, meta.seq_len, hkv, dim, generator=gen).to(device, dtype)
    scale = 0.9 * dim ** -0.5
    rows = (torch.randperm(meta.seq_len, generator=gen)[:ROWS] if cuda else torch.arange(meta.seq_len)).to(device)
    worst, elapsed, densities, routes = 0.0, 0.0, [], set()
    for layer in range(LAYERS if spec.name == "vmoba_attn" else 1):  # VMoBA: each chunk shape once
        sync(device)
        start = time.perf_counter()
        out = backend.forward(q, k, v, scale=scale, meta=meta, layer=layer)
        sync(device)
        elapsed += time.perf_counter() - start
        mask = _input_order_mask(backend, q, k, meta, layer, scale)
        density = float(mask.float().mean())
        if density >= 1.0:
            raise RuntimeError(f"{spec.name} attended every pair on the check's grid {grid}: the sparse path "
                               "was not exercised")
        densities.append(density)
        routes.add(str(getattr(backend, "route", None)))
        want = _reference(q, k, v, mask.expand(1, hq, -1, -1), rows, scale)
        worst = max(worst, (out[:, rows].double() - want).abs().max().item())
    shape = (f"grid {'x'.join(map(str, grid))}+{text} text H{hq}/{hkv} D{dim}, density "
             f"{min(densities):.2f}-{max(densities):.2f}, route {'/'.join(sorted(routes))}")
    return worst, elapsed * 1e3, shape


__all__ = ["SPARSE_BACKENDS", "sparse_problem"]
