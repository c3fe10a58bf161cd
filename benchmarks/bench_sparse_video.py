"""Sparse video attention on the lent GPU, one call: correctness vs float64, then timings vs dense baselines.

STA (sliding_tile_attn) through sglx's block-sparse routes (Triton kernel; FA4 block-sparse where flash-attn-4
imports) at Wan-shaped canvases, next to dense cuDNN SDPA and dense FA4 measured in the same run. Correctness:
sampled query rows of each route against a float64 masked reference (bf16 relative error <= 2e-2), in tile
order (kernel) and in input order (the backend, with the tile reordering). Timings: triton.testing.do_bench
medians; "with reorder" includes the gathers into tile order and back. Usage:

    PYTHONPATH=src python3 benchmarks/bench_sparse_video.py --out $OUT/sparse.json
    PYTHONPATH=src python3 benchmarks/bench_sparse_video.py --tiny --device cpu   # logic check on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.fa4_route import fa4_modules, fa4_supports
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.routes import run_block_sparse
from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend, _cached_layout
from sglx.attention.diffusion.sparse.sta_strategy import write_uniform_strategy
from sglx.attention.diffusion.sparse.tile_order import tile_order


def sampled_reference(q, k, v, layout: BlockSparseLayout, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 masked attention for query slots `rows` only: [B, len(rows), H, D]."""
    hq, hkv = q.shape[2], k.shape[2]
    blocks = layout.block_mask()  # [1|B, 1|H, nq, nk]
    cols = torch.arange(layout.seq_len, device=q.device) // layout.k_block
    allowed = blocks[:, :, rows // layout.q_block][:, :, :, cols] & layout.key_valid().to(q.device)
    qd = q[:, rows].double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vd = v.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def bench(fn, device: torch.device) -> float:
    """Median ms; at least ~150 ms of repeats and at least 8 of them (slow dense baselines)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=max(25, int(2 * est)), rep=max(150, int(8 * est)),
                                         return_mode="median"))


def dense_runs(q, k, v, scale, device) -> dict:
    """Dense baselines: cuDNN SDPA and FA4 (where it imports)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    runs = {}
    if device.type == "cuda":
        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        runs["dense cuDNN SDPA"] = cudnn
        mods = fa4_modules()
        if mods is not None:
            runs["dense FA4"] = lambda: mods[0](q, k, v, softmax_scale=scale, causal=False)
    else:
        runs["dense SDPA (cpu)"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return runs


def case(name: str, grid, window, heads: int, dim: int, device, dtype, tile, block, rows_n: int, time_it: bool,
         triton_configs) -> dict:
    torch.manual_seed(0)
    seq = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, seq, heads, dim, device=device, dtype=dtype) for _ in range(3))
    scale = dim ** -0.5
    order = tile_order(grid, tile, 0, True, block)
    layout = _cached_layout(order, (window,), str(device))
    res: dict = {"case": name, "grid": list(grid), "window_tiles": list(window), "tile": list(tile), "heads": heads,
                 "head_dim": dim, "tokens": seq, "slots_after_padding": order.slots,
                 "block_density": layout.density(),
                 "token_sparsity": 1 - layout_token_density(layout, order), "routes": {}}
    gather, scatter = order.gather.to(device), order.scatter.to(device)
    qp, kp, vp = (t.index_select(1, gather) for t in (q, k, v))
    rows = torch.randperm(order.slots, device=device)[:rows_n].sort().values
    real = order.scatter[torch.randperm(seq)[:rows_n]].to(device)  # slots of real tokens
    rows = torch.cat([rows, real]).unique()
    want = sampled_reference(qp, kp, vp, layout, rows, scale)
    routes = ["reference"] if device.type != "cuda" else ["triton"] + (["fa4"] if fa4_supports(q, layout) is None
                                                                       else [])
    if device.type == "cuda" and "fa4" not in routes:
        res["fa4_skipped"] = fa4_supports(q, layout)
    outs = {}
    for route in routes:
        out = run_block_sparse(qp, kp, vp, layout, scale, route)
        outs[route] = out
        entry = {"rel_err_vs_f64": rel_err(out[:, rows], want)}
        if time_it:
            entry["ms"] = bench(lambda r=route: run_block_sparse(qp, kp, vp, layout, scale, r), device)

            def with_reorder(r=route):
                a, b, c = (t.index_select(1, gather) for t in (q, k, v))
                return run_block_sparse(a, b, c, layout, scale, r).index_select(1, scatter)
            entry["ms_with_reorder"] = bench(with_reorder, device)
        res["routes"][route] = entry
    if time_it and device.type == "cuda" and not order.identity and order.slots == seq:  # step order applies
        res["step_reorder"] = step_reorder(order, heads * dim, device)
    if time_it and device.type == "cuda" and tuple(grid) == (18, 48, 80) and heads == 12:
        res["upstream"] = upstream_sta(qp, kp, vp, outs.get("fa4", outs.get("triton")), grid, window, device)
    if len(outs) > 1:
        res["fa4_vs_triton_max_abs"] = (outs["fa4"].float() - outs["triton"].float()).abs().max().item()
    # the backend in input order (tile reordering included) against the kernel's output moved back
    strategy = write_uniform_strategy(Path(os.environ.get("TMPDIR", "/tmp")) / "sta_bench.json", 1, heads, window)
    backend = SlidingTileAttentionBackend({"mask_strategy_file_path": str(strategy), "skip_time_steps": 0},
                                          tile=tile, block=block)
    meta = DiTAttnMetadata(grid=grid, num_heads=heads, head_dim=dim)
    got = backend.forward(q, k, v, scale=scale, meta=meta, layer=0)
    res["backend_route"] = backend.route
    res["backend_route_why"] = backend.route_why
    moved = order.scatter.to(device)
    inv_rows = torch.nonzero(torch.isin(moved, rows)).flatten()[:rows_n]  # tokens whose slots were checked
    want_tok = sampled_reference(qp, kp, vp, layout, moved[inv_rows], scale)
    res["backend_rel_err_vs_f64"] = rel_err(got[:, inv_rows], want_tok)
    if time_it:  # the backend's own path per route: reordering as the backend does it (Triton: q_map fused)
        for route in routes:
            os.environ["SGLX_BLOCK_SPARSE_ROUTE"] = route
            try:
                out_r = backend.forward(q, k, v, scale=scale, meta=meta, layer=0)
                res["routes"][route]["backend_rel_err_vs_f64"] = rel_err(out_r[:, inv_rows], want_tok)
                res["routes"][route]["backend_ms"] = bench(
                    lambda: backend.forward(q, k, v, scale=scale, meta=meta, layer=0), device)
            finally:
                os.environ.pop("SGLX_BLOCK_SPARSE_ROUTE", None)
    if time_it and device.type == "cuda":
        res["dense"] = {n: bench(fn, device) for n, fn in dense_runs(q, k, v, scale, device).items()}
        base = res["dense"].get("dense cuDNN SDPA")
        if base:
            per_layer = res.get("step_reorder", {}).get("ms_per_layer")
            for entry in res["routes"].values():
                entry["x_cudnn"] = base / entry["ms"]
                entry["x_cudnn_with_reorder"] = base / entry["ms_with_reorder"]
                if per_layer is not None:  # the tile order kept across the step: its cost shared by the layers
                    entry["ms_with_step_reorder"] = entry["ms"] + per_layer
                    entry["x_cudnn_with_step_reorder"] = base / entry["ms_with_step_reorder"]
            if isinstance(res.get("upstream"), dict) and "ms" in res["upstream"]:
                res["upstream"]["x_cudnn"] = base / res["upstream"]["ms"]
                if "backend_ms" in entry:
                    entry["x_cudnn_backend"] = base / entry["backend_ms"]
        if triton_configs:
            res["triton_sweep"] = sweep(qp, kp, vp, layout, scale, triton_configs, device)
    return res


def step_reorder(order, width: int, device, layers: int = 30) -> dict:
    """What keeping the tile order across a whole DiT step costs (sliding_tile's step order): the hidden states
    [1, S, width] (bf16) and the two float32 rotary tables [1, S, 1, 128] gathered into tile order once before
    the first block, the hidden states moved back once after the last; shared by `layers` attention layers."""
    seq = int(order.scatter.numel())
    gather, scatter = order.gather.to(device), order.scatter.to(device)
    hidden = torch.randn(1, seq, width, device=device, dtype=torch.bfloat16)
    cos, sin = (torch.randn(1, seq, 1, 128, device=device) for _ in range(2))

    def once():
        h = hidden.index_select(1, gather)
        c, s = cos.index_select(1, gather), sin.index_select(1, gather)
        return h.index_select(1, scatter), c, s
    ms = bench(once, device)
    return {"ms_per_step": ms, "layers": layers, "ms_per_layer": ms / layers, "hidden_width": width}


def upstream_sta(qp, kp, vp, ours, grid, window, device) -> dict:
    """FastVideo's STA (fastvideo_kernel, where installed) on the same tile-ordered tokens: a same-run anchor. It
    takes [B, H, S, D] in tile order (FastVideo's tile order is sglx's on these canvases: row-major tiles,
    row-major inside a tile, no padding) and only its three canvases (sglx.bench.sparse_upstream.sta_kernel,
    which `sglx bench diffusion --attention-backend sliding_tile_attn` uses too)."""
    from sglx.bench.sparse_upstream import sta_kernel

    try:
        run, path = sta_kernel([t.transpose(1, 2).contiguous() for t in (qp, kp, vp)],
                               [list(window)] * qp.shape[2], "x".join(map(str, grid)))
    except Exception as exc:  # noqa: BLE001 - not installed or a canvas it rejects: no anchor here
        return {"skipped": f"{type(exc).__name__}: {str(exc)[:200]}"}
    try:
        got = run().transpose(1, 2)
        err = rel_err(got, ours.double()) if ours is not None else None
        return {"ms": bench(run, device), "rel_err_vs_sglx": err, "path": path}
    except Exception as exc:  # noqa: BLE001 - upstream failing is a data point
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def layout_token_density(layout: BlockSparseLayout, order) -> float:
    """Share of (real query, real key) pairs attended."""
    lengths = order.k_lengths.double() if order.k_lengths is not None else torch.full(
        (layout.num_k_blocks,), float(layout.k_block), dtype=torch.float64)
    if order.k_lengths is None and layout.seq_len % layout.k_block:
        lengths[-1] = layout.seq_len % layout.k_block
    bm = layout.block_mask()[0, 0].double().cpu()  # [nq, nk]
    pairs = (lengths[:, None] * bm * lengths[None, :]).sum().item()
    real = lengths.sum().item()
    return pairs / real ** 2


def sweep(qp, kp, vp, layout, scale, configs, device) -> list[dict]:
    from sglx.attention.kernels.block_sparse_attention import BlockSparseConfig, block_sparse_attention

    out = []
    for bm, bn, warps, stages in configs:
        cfg = BlockSparseConfig(bm, bn, warps, stages)
        try:
            ms = bench(lambda c=cfg: block_sparse_attention(qp, kp, vp, layout, scale, config=c), device)
            out.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "ms": ms})
        except Exception as exc:  # a config that does not compile is a data point, not a failure
            out.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages,
                        "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return out


def step_case(device: torch.device, window=(3, 3, 3), tiny: bool = False) -> dict:
    """One denoising step of a dummy-weight Wan2.1-1.3B at 81x480x832 (grid 21x30x52, one CFG branch):
    diffusers' own forward (native / cuDNN attention) vs sglx's processors with dense and STA backends."""
    from sglx.attention.diffusion.base import DiffusionAttentionBackend
    from sglx.attention.diffusion.metadata import dit_step
    from sglx.attention.diffusion.sdpa import TorchSDPABackend
    from sglx.bench.diffusion_step import StepConfig, _build, _metadata
    from sglx.diffusion.processors.wan import install

    class Switch(DiffusionAttentionBackend):
        inner: DiffusionAttentionBackend

        def forward_dense(self, q, k, v, *, scale=None):
            return self.inner.forward_dense(q, k, v, scale=scale)

        def forward(self, q, k, v, *, scale=None, meta=None, layer=0):
            return self.inner.forward(q, k, v, scale=scale, meta=meta, layer=layer)

    cfg = StepConfig(tiny=True, frames=5, height=64, width=64, text_tokens=8) if tiny else StepConfig()
    model, inputs = _build(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    layers, heads = cfg.model_config()["num_layers"], cfg.model_config()["num_attention_heads"]
    res: dict = {"case": "wan2.1-1.3b step 81x480x832", "window_tiles": list(window), "rows": {}}
    outs = {}
    with torch.inference_mode():
        for name in ("native", "_native_cudnn"):
            try:
                model.set_attention_backend(name)
                outs[name] = model(**inputs, return_dict=False)[0]
                res["rows"][f"diffusers {name}"] = bench(lambda: model(**inputs, return_dict=False)[0], device)
            except Exception as exc:
                res["rows"][f"diffusers {name}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        model.reset_attention_backend()
    switch = Switch()
    install(model, switch)
    meta = _metadata(model, tuple(inputs["hidden_states"].shape))
    strategy = write_uniform_strategy(Path(os.environ.get("TMPDIR", "/tmp")) / "sta_step.json", layers, heads, window)
    sta = SlidingTileAttentionBackend({"mask_strategy_file_path": str(strategy), "skip_time_steps": 0})
    inners = [("sglx torch_sdpa (dense)", TorchSDPABackend(), None), ("sglx STA", sta, None),
              ("sglx STA triton route", sta, "triton")]
    if fa4_modules() is not None:
        from sglx.attention.diffusion.flash_attn import FlashAttentionBackend

        inners.insert(1, ("sglx fa (dense FA4)", FlashAttentionBackend(kernel=fa4_modules()[0], variant="FA4"), None))
    base = outs.get("_native_cudnn", outs.get("native"))
    with torch.inference_mode():
        for label, inner, route in inners:
            switch.inner = inner
            if route:
                os.environ["SGLX_BLOCK_SPARSE_ROUTE"] = route
            try:
                with dit_step(meta):
                    got = model(**inputs, return_dict=False)[0]

                    def fwd():
                        return model(**inputs, return_dict=False)[0]
                    ms = bench(fwd, device)
                res["rows"][label] = ms
                if base is not None:
                    res[f"rel_l2 {label} vs diffusers"] = rel_err(got, base.double())
                if inner is sta:
                    res[f"route {label}"] = sta.route
            except Exception as exc:
                res["rows"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                os.environ.pop("SGLX_BLOCK_SPARSE_ROUTE", None)
    timed = {k: v for k, v in res["rows"].items() if isinstance(v, float)}
    best_diffusers = min((v for k, v in timed.items() if k.startswith("diffusers")), default=None)
    if best_diffusers:
        res["over_best_diffusers"] = {k: v / best_diffusers for k, v in timed.items()}
    return res


def step_order_case(device: torch.device, window=(3, 3, 3), tiny: bool = False) -> dict:
    """One denoising step of the dummy-weight Wan2.1-1.3B at 69x768x1280 (grid 18x48x80, 69,120 tokens, one CFG
    branch), all 30 layers STA 3x3x3 (85%): the tile order kept across the step (sglx.diffusion.step_order: one
    reorder per step) against the same STA reordering in every layer, in one run."""
    import copy

    from sglx.attention.diffusion.base import DiffusionAttentionBackend
    from sglx.attention.diffusion.metadata import dit_step
    from sglx.bench.diffusion_step import StepConfig, _build, _metadata
    from sglx.diffusion.processors.wan import install

    class Switch(DiffusionAttentionBackend):  # no step_order: the wrapped backend reorders in every layer
        inner: DiffusionAttentionBackend

        def forward_dense(self, q, k, v, *, scale=None):
            return self.inner.forward_dense(q, k, v, scale=scale)

        def forward(self, q, k, v, *, scale=None, meta=None, layer=0):
            return self.inner.forward(q, k, v, scale=scale, meta=meta, layer=layer)

    cfg = StepConfig(tiny=True, frames=5, height=64, width=256, text_tokens=8) if tiny else StepConfig(
        frames=69, height=768, width=1280)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    window = (1, 1, 1) if tiny else window
    model, inputs = _build(cfg, device, dtype)
    layers, heads = cfg.model_config()["num_layers"], cfg.model_config()["num_attention_heads"]
    meta = _metadata(model, tuple(inputs["hidden_states"].shape))
    strategy = write_uniform_strategy(Path(os.environ.get("TMPDIR", "/tmp")) / "sta_step_order.json", layers, heads,
                                      window)
    sta_kw = {"tile": (1, 2, 8), "block": 16} if tiny else {}
    sta = SlidingTileAttentionBackend({"mask_strategy_file_path": str(strategy), "skip_time_steps": 0}, **sta_kw)
    kept = copy.deepcopy(model)
    install(kept, sta)
    switch = Switch()
    install(model, switch)
    res: dict = {"case": f"wan2.1-1.3b step {cfg.frames}x{cfg.height}x{cfg.width}", "grid": list(meta.grid),
                 "window_tiles": list(window), "rows": {}}
    rows = [("sglx STA, tile order kept across the step", kept, None),
            ("sglx STA, reordered in every layer", model, sta)]  # (dense rows: the 480p step, --sparse-step)
    outs = {}
    with torch.inference_mode(), dit_step(meta):
        for label, mod, inner in rows:
            if inner is not None:
                switch.inner = inner
            try:
                outs[label] = mod(**inputs, return_dict=False)[0]
                res["rows"][label] = bench(lambda m=mod: m(**inputs, return_dict=False)[0], device)
            except Exception as exc:  # noqa: BLE001 - a failing row is a data point
                res["rows"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
    res["route"] = sta.route
    a, b = (outs.get(rows[i][0]) for i in (0, 1))
    if a is not None and b is not None:
        res["rel_l2_kept_vs_per_layer"] = rel_err(a, b.double())
    return res


def sparse_step_case(device: torch.device, tiny: bool = False) -> dict:
    """One denoising step of the dummy-weight Wan2.1-1.3B at 81x480x832 (grid 21x30x52, one CFG branch) with each
    sparse backend at its default config on a late step (40 of 50: past every dense warm-up step; dense warm-up
    layers stay dense), next to diffusers' own `native` attention and sglx's dense FA4 in the same run."""
    from sglx.attention.diffusion.base import DiffusionAttentionBackend
    from sglx.attention.diffusion.metadata import dit_step
    from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend
    from sglx.attention.diffusion.sparse.video_sparse import VideoSparseAttentionBackend
    from sglx.attention.diffusion.sparse.vmoba import VMoBABackend
    from sglx.bench.diffusion_step import StepConfig, _build, _metadata
    from sglx.diffusion.processors.wan import install

    class Switch(DiffusionAttentionBackend):
        inner: DiffusionAttentionBackend

        def forward_dense(self, q, k, v, *, scale=None):
            return self.inner.forward_dense(q, k, v, scale=scale)

        def forward(self, q, k, v, *, scale=None, meta=None, layer=0):
            return self.inner.forward(q, k, v, scale=scale, meta=meta, layer=layer)

        def step_order(self, meta, hidden):  # the inner backend's order for the whole step (STA, VSA), if any
            order = getattr(self.inner, "step_order", None)
            return None if order is None else order(meta, hidden)

    class PerLayer(Switch):  # the same backend reordering tokens in every layer (no order kept for the step)
        def __init__(self, inner):
            super().__init__({})
            self.inner = inner

        def step_order(self, meta, hidden):
            return None

    cfg = StepConfig(tiny=True, frames=5, height=64, width=64, text_tokens=8) if tiny else StepConfig()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, inputs = _build(cfg, device, dtype)
    layers, heads = cfg.model_config()["num_layers"], cfg.model_config()["num_attention_heads"]
    res: dict = {"case": f"wan2.1-1.3b step {cfg.frames}x{cfg.height}x{cfg.width}, step 40 of 50", "rows": {},
                 "density": {}}
    outs = {}
    with torch.inference_mode():
        try:
            model.set_attention_backend("native")
            outs["diffusers native"] = model(**inputs, return_dict=False)[0]
            res["rows"]["diffusers native"] = bench(lambda: model(**inputs, return_dict=False)[0], device)
        except Exception as exc:  # noqa: BLE001
            res["rows"]["diffusers native"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        model.reset_attention_backend()
    switch = Switch()
    install(model, switch)
    meta = replace(_metadata(model, tuple(inputs["hidden_states"].shape)), step_index=40, num_steps=50)
    strategy = write_uniform_strategy(Path(os.environ.get("TMPDIR", "/tmp")) / "sta_sparse_step.json", layers, heads,
                                      (3, 3, 3))
    inners = [("sglx sliding_tile_attn 3x3x3", SlidingTileAttentionBackend({"mask_strategy_file_path": str(strategy)})),
              ("sglx video_sparse_attn sparsity 0.875", VideoSparseAttentionBackend({"sparsity": 0.875})),
              ("sglx video_sparse_attn sparsity 0.875, reordered in every layer",
               PerLayer(VideoSparseAttentionBackend({"sparsity": 0.875}))),
              ("sglx vmoba_attn default", VMoBABackend({})),
              ("sglx sparse_video_gen_2_attn default", SparseVideoGen2Backend({}))]
    if fa4_modules() is not None:
        from sglx.attention.diffusion.flash_attn import FlashAttentionBackend

        inners.insert(0, ("sglx fa (dense FA4)", FlashAttentionBackend(kernel=fa4_modules()[0], variant="FA4")))
    with torch.inference_mode(), dit_step(meta):
        for label, inner in inners:
            switch.inner = inner
            try:
                outs[label] = model(**inputs, return_dict=False)[0]  # SVG2: this call clusters (50 iterations)

                def step(inner=inner):
                    for state in getattr(getattr(inner, "state", None), "layers", {}).values():
                        state.step = meta.step_index - 1  # as if the previous step clustered: 2 warm iterations
                    return model(**inputs, return_dict=False)[0]
                res["rows"][label] = bench(step, device)
                layout = getattr(inner, "last_layout", None)
                if layout is not None:
                    res["density"][label] = layout.density()
                if getattr(inner, "route", None):
                    res.setdefault("route", {})[label] = inner.route
            except Exception as exc:  # noqa: BLE001 - a failing row is a data point
                res["rows"][label] = f"{type(exc).__name__}: {str(exc)[:300]}"
    base = outs.get("diffusers native")
    if base is not None:
        res["rel_l2_vs_diffusers"] = {k: rel_err(v, base.double()) for k, v in outs.items()}
    timed = {k: v for k, v in res["rows"].items() if isinstance(v, float)}
    if isinstance(timed.get("diffusers native"), float):
        res["over_diffusers"] = {k: v / timed["diffusers native"] for k, v in timed.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sparse_video.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--step-order", action="store_true", help="also the 18x48x80 Wan step with the tile order kept")
    ap.add_argument("--sparse-step", action="store_true", help="also the 480p Wan step with each sparse backend")
    ap.add_argument("--cases", default="", help="only cases whose name contains one of these (comma-separated)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    mods = fa4_modules()
    info["fa4"] = "importable" if mods is not None else "not importable"
    if mods is not None:
        import importlib.metadata as md
        with contextlib.suppress(md.PackageNotFoundError):
            info["flash_attn_4"] = md.version("flash-attn-4")
    configs = [] if args.no_sweep else [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 128, 4, 3),
                                        (128, 128, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3)]
    if args.tiny:
        plan = [("tiny odd", (5, 7, 9), (3, 3, 3), 2, 64, (2, 2, 2), 16, 64, True, [])]
    else:
        plan = [
            ("wan1.3b-480p 3x3x3 (padded tiles)", (21, 30, 52), (3, 3, 3), 12, 128, (6, 8, 8), 128, 256, True,
             configs),
            ("wan 18x48x80 3x3x3 (85%)", (18, 48, 80), (3, 3, 3), 12, 128, (6, 8, 8), 128, 256, True, configs),
            ("wan 18x48x80 3x3x5 (75%)", (18, 48, 80), (3, 3, 5), 12, 128, (6, 8, 8), 128, 256, True, []),
            ("wan 18x48x80 3x3x3 D64 24 heads", (18, 48, 80), (3, 3, 3), 24, 64, (6, 8, 8), 128, 128, True, []),
            ("hunyuan 30x48x80 3x3x3 (91%)", (30, 48, 80), (3, 3, 3), 12, 128, (6, 8, 8), 128, 128, True, []),
            ("wan1.3b-480p 3x3x5 (padded tiles)", (21, 30, 52), (3, 3, 5), 12, 128, (6, 8, 8), 128, 128, True, []),
        ]
    wanted = [w for w in args.cases.split(",") if w]
    plan = [p for p in plan if not wanted or any(w in p[0] for w in wanted)]
    results = {"info": info, "cases": []}
    for name, grid, window, heads, dim, tile, block, rows_n, time_it, cfgs in plan:
        start = time.time()
        try:
            res = case(name, grid, window, heads, dim, device, dtype, tile, block, rows_n, time_it, cfgs)
        except Exception as exc:
            res = {"case": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["wall_s"] = round(time.time() - start, 1)
        results["cases"].append(res)
        print(json.dumps(res), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if not args.no_step:
        start = time.time()
        try:
            res = step_case(device, tiny=args.tiny)
        except Exception as exc:
            res = {"case": "wan2.1-1.3b step", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["wall_s"] = round(time.time() - start, 1)
        results["step"] = res
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(json.dumps(res), flush=True)
    if args.sparse_step:
        start = time.time()
        try:
            res = sparse_step_case(device, tiny=args.tiny)
        except Exception as exc:  # noqa: BLE001
            res = {"case": "wan2.1-1.3b step, sparse backends", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["wall_s"] = round(time.time() - start, 1)
        results["sparse_step"] = res
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(json.dumps(res), flush=True)
    if args.step_order:
        start = time.time()
        try:
            res = step_order_case(device, tiny=args.tiny)
        except Exception as exc:  # noqa: BLE001
            res = {"case": "wan2.1-1.3b step 18x48x80", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["wall_s"] = round(time.time() - start, 1)
        results["step_order"] = res
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(json.dumps(res), flush=True)
    print(json.dumps(info))
    for r in results["cases"]:
        dense = r.get("dense", {})
        line = [r["case"], f"sparsity {r.get('token_sparsity', 0):.3f}"]
        line += [f"{n} {ms:.2f}ms" for n, ms in dense.items()]
        for route, e in r.get("routes", {}).items():
            line.append(f"{route} err {e['rel_err_vs_f64']:.1e} {e.get('ms', 0):.2f}ms "
                        f"(+reorder {e.get('ms_with_reorder', 0):.2f}, backend {e.get('backend_ms', 0):.2f}) "
                        f"x{e.get('x_cudnn', 0):.2f} (step-order x{e.get('x_cudnn_with_step_reorder', 0):.2f})")
        up = r.get("upstream", {})
        if "ms" in up:
            line.append(f"upstream STA {up['ms']:.2f}ms x{up.get('x_cudnn', 0):.2f} err {up.get('rel_err_vs_sglx')}")
        print(" | ".join(line), r.get("error", ""))
    if "sparse_step" in results:
        r = results["sparse_step"]
        print(r["case"], {k: round(v, 1) if isinstance(v, float) else v for k, v in r.get("rows", {}).items()},
              r.get("error", ""))
    if "step_order" in results:
        r = results["step_order"]
        print(r["case"], r.get("rows"), "rel_l2", r.get("rel_l2_kept_vs_per_layer"), r.get("error", ""))


if __name__ == "__main__":
    main()
