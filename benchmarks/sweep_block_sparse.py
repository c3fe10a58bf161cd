"""Launch sweep of sglx's Triton block-sparse kernel on the lent GPU: which tile sizes, warps and stages are fastest.

Cases: STA 3x3x3 on 18x48x80 (85%, 128-token blocks, no padding), VSA top-k 12.5% on Wan2.1-1.3B's 21x30x52
grid (64-token cubes, clustered q/k) and STA 3x3x3 on 21x30x52 (padded tiles). Configs include K/V loads
through TMA descriptors (BlockSparseConfig.tma). Every config is checked
against float64 on sampled query rows before it is timed (bf16 relative error <= 2e-2), and the kernel's
default launch is timed in the same run. Usage:

    PYTHONPATH=src python3 benchmarks/sweep_block_sparse.py --out $OUT/sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_backends import clustered  # noqa: E402
from bench_sparse_video import bench, rel_err, sampled_reference  # noqa: E402

from sglx.attention.diffusion.metadata import DiTAttnMetadata  # noqa: E402
from sglx.attention.diffusion.sparse.sliding_tile import _cached_layout  # noqa: E402
from sglx.attention.diffusion.sparse.tile_order import tile_order  # noqa: E402
from sglx.attention.diffusion.sparse.tiled import to_order  # noqa: E402
from sglx.attention.diffusion.sparse.video_sparse import vsa_plan  # noqa: E402
from sglx.attention.kernels.block_sparse_attention import (  # noqa: E402
    BlockSparseConfig,
    _launch,
    block_sparse_attention,
)

# (block_m, block_n, warps, stages, K/V through TMA descriptors)
CONFIGS_128 = [(128, 64, 4, 2, False), (128, 64, 4, 3, False), (128, 64, 8, 2, False), (128, 128, 8, 2, False),
               (128, 128, 8, 3, False), (64, 64, 4, 2, False), (64, 128, 4, 2, False), (128, 32, 4, 2, False),
               (128, 64, 4, 2, True), (128, 64, 4, 3, True), (128, 128, 8, 2, True), (128, 128, 8, 3, True),
               (128, 64, 8, 3, True)]
CONFIGS_64 = [(64, 64, 4, 2, False), (64, 64, 4, 3, False), (64, 64, 4, 4, False), (64, 64, 8, 2, False),
              (64, 32, 4, 2, False), (32, 64, 4, 2, False), (64, 64, 4, 2, True), (64, 64, 4, 3, True),
              (64, 64, 8, 3, True)]


def sta_case(grid, device):
    gen = torch.Generator().manual_seed(0)
    seq = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(1, seq, 12, 128, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    order = tile_order(grid, (6, 8, 8), 0, True, 128)
    layout = _cached_layout(order, ((3, 3, 3),), str(device))
    return tuple(to_order(t, order) for t in (q, k, v)), layout, CONFIGS_128


def vsa_case(device, grid=(21, 30, 52)):
    meta = DiTAttnMetadata(grid=grid, num_heads=12, head_dim=128)
    gen = torch.Generator().manual_seed(0)
    shape = (1, meta.seq_len, 12, 128)
    q, k = (clustered(shape, gen).to(device, torch.bfloat16) for _ in range(2))
    v = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    plan = vsa_plan(q, k, meta, 0.875, 128 ** -0.5)
    return tuple(to_order(t, plan.order) for t in (q, k, v)), plan.layout, CONFIGS_64


def sweep(name, tensors, layout, configs, device, save=None) -> dict:
    q, k, v = tensors
    scale = q.shape[-1] ** -0.5
    rows = torch.randperm(layout.seq_len, device=device)[:256].sort().values
    want = sampled_reference(q, k, v, layout, rows, scale)
    default = _launch(BlockSparseConfig(), layout, q.shape[-1], q.device)
    res = {"case": name, "density": layout.density(), "default": list(default), "runs": []}
    for cfg in [default] + [c for c in configs if c != default]:
        entry = {"block_m": cfg[0], "block_n": cfg[1], "warps": cfg[2], "stages": cfg[3], "tma": cfg[4],
                 "default": cfg == default}
        try:
            c = BlockSparseConfig(*cfg)
            out = block_sparse_attention(q, k, v, layout, scale, config=c)
            entry["rel_err"] = rel_err(out[:, rows], want)
            if entry["rel_err"] <= 2e-2:
                entry["ms"] = bench(lambda c=c: block_sparse_attention(q, k, v, layout, scale, config=c), device)
        except Exception as exc:  # a config that does not compile is a data point, not a failure
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        res["runs"].append(entry)
        print(json.dumps({"case": name, **entry}), flush=True)
        if save is not None:
            save(res)
    timed = [r for r in res["runs"] if "ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        res["best"] = best
        res["default_ms"] = next((r["ms"] for r in timed if r["default"]), None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated (block_m, block_n, warps, stages, tma) tuples to time "
                    "besides the default, e.g. '128-64-4-3-1'; empty: the whole sweep")
    ap.add_argument("--cases", default="", help="only cases whose name contains this")
    ap.add_argument("--vsa-wan-720p", action="store_true", help="also VSA 0.875 on 18x48x80 (issue 11's target canvas)")
    args = ap.parse_args()
    only = [tuple(int(x) for x in c.split("-")) for c in args.only.split(",") if c]
    only = [c[:4] + (bool(c[4]),) for c in only]
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    import triton
    results["triton"] = triton.__version__
    cases = [("STA 3x3x3 18x48x80 (85%)", lambda: sta_case((18, 48, 80), device)),
             ("VSA 0.875 21x30x52 (64-token cubes)", lambda: vsa_case(device)),
             ("STA 3x3x3 21x30x52 (padded tiles)", lambda: sta_case((21, 30, 52), device))]
    if args.vsa_wan_720p:
        cases.append(("VSA 0.875 18x48x80 (64-token cubes)", lambda: vsa_case(device, (18, 48, 80))))
    for name, make in cases:
        if args.cases not in name:
            continue
        tensors, layout, configs = make()
        if args.only:  # tiles that do not divide the case's blocks fail their row, quickly
            configs = only

        def save(partial):  # written after every config: a timeout keeps what was measured
            args.out.write_text(json.dumps({**results, "cases": results["cases"] + [partial]}, indent=1))
        results["cases"].append(sweep(name, tensors, layout, configs, device, save))
        args.out.write_text(json.dumps(results, indent=1))
    for r in results["cases"]:
        best = r.get("best", {})
        print(f"{r['case']}: default {r['default']} {r.get('default_ms')} ms; best "
              f"{[best.get(x) for x in ('block_m', 'block_n', 'warps', 'stages', 'tma')]} {best.get('ms')} ms")


if __name__ == "__main__":
    main()
