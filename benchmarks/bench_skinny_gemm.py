"""Time sglx's skinny decode GEMM against F.linear (cuBLAS) at Llama-3.1-8B projection shapes.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_skinny_gemm.py --output skinny.json [--sweep]
Each product is checked against F.linear first; times are triton.testing.do_bench medians (L2 flushed
between runs), GB/s counts the weight bytes. --sweep times other tile shapes at one row.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from sglx.llm.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_linear

DEV = torch.device("cuda")
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
SWEEP = [SkinnyConfig(bn, bk, 4, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4)
         if bn * bk <= 64 * 256]


def median_ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-rows", default="1", help="row counts the --sweep configs run at")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    results: dict = dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                         python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                         timing="triton.testing.do_bench median (L2 flushed)", cases=[])
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            ref = F.linear(x, w)
            cublas = median_ms(lambda x=x, w=w: F.linear(x, w))
            # above MAX_ROWS only configs with rows-wide blocks run (block_m = the next power of two)
            wide = max(16, triton.next_power_of_2(rows))
            sweep = SWEEP if args.sweep and str(rows) in args.sweep_rows.split(",") else []
            configs = [replace(c, block_m=wide) if rows > MAX_ROWS else c for c in [SkinnyConfig(), *sweep]]
            for cfg in configs:
                row = dict(shape=name, n=n, k=k, rows=rows, config=cfg.__dict__,
                           default=replace(cfg, block_m=None) == SkinnyConfig(),
                           cublas_ms=cublas, cublas_gb_s=n * k * 2 / cublas / 1e6)
                try:
                    out = skinny_linear(x, w, config=cfg)
                    row["max_abs_diff_vs_cublas"] = (out.float() - ref.float()).abs().max().item()
                    ms = median_ms(lambda x=x, w=w, cfg=cfg: skinny_linear(x, w, config=cfg))
                    row.update(ms=ms, gb_s=n * k * 2 / ms / 1e6, ratio_to_cublas=ms / cublas)
                    print(f"{name} rows={rows} {cfg}: {ms * 1e3:.1f} us ({row['gb_s']:.0f} GB/s) vs cuBLAS "
                          f"{cublas * 1e3:.1f} us ({row['cublas_gb_s']:.0f} GB/s) x{ms / cublas:.3f} "
                          f"diff {row['max_abs_diff_vs_cublas']:.2e}", flush=True)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"{name} rows={rows} {cfg}: {row['error']}", flush=True)
                results["cases"].append(row)
            if args.output:
                args.output.write_text(json.dumps(results, indent=1))
    print("\nsummary (default config):")
    for r in results["cases"]:
        if r["default"] and "ms" in r:
            print(f"  {r['shape']:>12} rows {r['rows']:>2}: {r['ms'] * 1e3:7.1f} us vs cuBLAS "
                  f"{r['cublas_ms'] * 1e3:7.1f} us  x{r['ratio_to_cublas']:.3f}  "
                  f"({r['gb_s']:.0f} vs {r['cublas_gb_s']:.0f} GB/s)")


if __name__ == "__main__":
    main()
