"""Batch-1 projections: cuBLAS, the skinny `tl.dot` GEMM and the CUDA-core GEMV (with its norm prologue), in graphs.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_gemv.py --out gemv.json [--sweep]
Shapes: Llama-3.1-8B's qkv / o / gate_up / down / LM head and DeepSeek-V2-Lite's fused q + kv_a, o_proj and LM
head. Each implementation runs as a chain of calls over distinct weights (at least 512 MB together, so no call
finds its weight in L2) captured in one CUDA graph, as a decode step runs its layers; every implementation is
checked against a float64 product first. Projections that follow a residual add + RMSNorm in the model also time
that norm: as its own kernel before cuBLAS or the GEMV, or inside the GEMV. TB/s counts weight bytes; the
device's copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from sglx.bench.timing import checked_us_in_graph, copy_bandwidth
from sglx.llm.kernels.gemv import GemvConfig, NormInput, gemv
from sglx.llm.kernels.rmsnorm import fused_add_rms_norm
from sglx.llm.kernels.skinny_gemm import skinny_linear

DEV = torch.device("cuda")
SHAPES = {"llama qkv": (6144, 4096), "llama o_proj": (4096, 4096), "llama gate_up": (28672, 4096),
          "llama down": (4096, 14336), "llama lm_head": (128256, 4096), "v2-lite q+kv_a": (3648, 2048),
          "v2-lite o_proj": (2048, 2048), "v2-lite lm_head": (102400, 2048)}
NORMED = ("llama qkv", "llama gate_up", "v2-lite q+kv_a")  # projections that read a residual add + RMSNorm
SWEEP = [GemvConfig(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024, 2048) for w in (4, 8)
         if bn * bk <= 8192]
EPS = 1e-5
Call = Callable[[int], torch.Tensor]


def _impls(name: str, ws: list[torch.Tensor], sweep: bool, gen: torch.Generator
           ) -> dict[str, tuple[Call, torch.Tensor]]:
    """label -> (call(i) over weight i, its float64 reference for weight 0)."""
    k = ws[0].shape[1]
    x = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
    want = (x.double() @ ws[0].double().t()).float()
    impls: dict[str, tuple[Call, torch.Tensor]] = {
        "cublas": (lambda i: F.linear(x, ws[i]), want), "skinny": (lambda i: skinny_linear(x, ws[i]), want)}
    for cfg in ([GemvConfig(), *SWEEP] if sweep else [GemvConfig()]):
        impls[f"gemv {cfg.block_n},{cfg.block_k},{cfg.num_warps}"] = (
            lambda i, cfg=cfg: gemv(x, ws[i], config=cfg)[0], want)
    if name not in NORMED:
        return impls
    r = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
    g = (1 + 0.1 * torch.randn(k, generator=gen, device=DEV)).bfloat16()
    normed = (fused_add_rms_norm(x, r, g, EPS)[0].double() @ ws[0].double().t()).float()
    impls.update({
        "norm kernel + cublas": (lambda i: F.linear(fused_add_rms_norm(x, r, g, EPS)[0], ws[i]), normed),
        "norm kernel + gemv": (lambda i: gemv(fused_add_rms_norm(x, r, g, EPS)[0], ws[i])[0], normed),
        "gemv add+norm inside": (lambda i: gemv(x, ws[i], norm=NormInput(g, EPS, r))[0], normed)})
    for cfg in SWEEP if sweep else ():  # the norm-inside variant at every launch too (the model runs it)
        impls[f"gemv add+norm inside {cfg.block_n},{cfg.block_k},{cfg.num_warps}"] = (
            lambda i, cfg=cfg: gemv(x, ws[i], norm=NormInput(g, EPS, r), config=cfg)[0], normed)
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true", help="time every GemvConfig in SWEEP, not only the default")
    parser.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (default all)")
    args = parser.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    bw = copy_bandwidth(DEV)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_tb_s=bw / 1e12, cases=[])
    gen = torch.Generator(DEV).manual_seed(0)
    for name in names:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        calls = max(2, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(calls)]
        case = dict(shape=name, n=n, k=k, calls=calls, weight_bytes=nbytes, rows={})
        for label, (call, want) in _impls(name, ws, args.sweep, gen).items():
            row = checked_us_in_graph(call, calls, want, 2e-2 * want.abs().max().item(), DEV)
            if "us_per_call" in row:
                row["tb_s"] = nbytes / row["us_per_call"] / 1e6
                row["of_copy"] = row["tb_s"] * 1e12 / bw
            case["rows"][label] = row
        report["cases"].append(case)
        rows = case["rows"]
        best = min((r["us_per_call"], lb) for lb, r in rows.items() if "us_per_call" in r and "norm" not in lb)
        us = {lb: rows[lb].get("us_per_call", 0.0) for lb in ("cublas", "skinny", "gemv None,None,None")}
        print(f"{name:16s} {n}x{k}: cublas {us['cublas']:.2f} us, skinny {us['skinny']:.2f}, gemv default "
              f"{us['gemv None,None,None']:.2f};"
              f" best {best[1]} {best[0]:.2f} us ({nbytes / best[0] / 1e6 / (bw / 1e12):.0%} of copy)", flush=True)
        inside = "gemv add+norm inside "
        normed_rows = [(r["us_per_call"], lb.removeprefix(inside)) for lb, r in rows.items()
                       if "us_per_call" in r and lb.startswith(inside)]
        if normed_rows:
            us_best, launch = min(normed_rows)
            print(f"    best gemv add+norm inside launch: {launch} {us_best:.2f} us", flush=True)
        for label, row in rows.items():
            if "norm" in label and not label.startswith(inside):
                print(f"    {label:24s} {row.get('us_per_call', float('nan')):.2f} us {row.get('error', '')}",
                      flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
