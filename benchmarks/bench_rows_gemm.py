"""Few-row decode GEMMs (sglx.llm.kernels.rows_gemm) against cuBLAS, and a batched decode layer's products with their
epilogues against cuBLAS plus the small kernels they replace, in CUDA graphs (Llama-3.1-8B shapes).

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_rows_gemm.py --rows 64 --out rows_gemm.json [--sweep]
Products: each shape as a chain of calls over distinct weights (at least 512 MB together) in one CUDA graph, checked
against F.linear first. Layer: per layer, the current route (fused add + RMSNorm, F.linear qkv, F.linear o_proj, add +
RMSNorm, F.linear gate_up, SiLU-and-mul, F.linear down) against the folded one (rows_gemm: qkv norming its rows,
o_proj adding to the stream in place, gate_up norming and applying SiLU-and-mul, down adding to the stream); attention
and rotary are outside both. Four layers of distinct weights a graph.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from sglx.bench.timing import checked_us_in_graph, copy_bandwidth
from sglx.llm.kernels.activation import silu_and_mul
from sglx.llm.kernels.rmsnorm import fused_add_rms_norm
from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm

DEV = torch.device("cuda")
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
EPS = 1e-5
SWEEP = [RowsGemmConfig(64, 128, None, 4, 4), RowsGemmConfig(64, 64, None, 4, 6), RowsGemmConfig(32, 128, None, 4, 4),
         RowsGemmConfig(32, 256, None, 4, 3), RowsGemmConfig(128, 64, None, 8, 4), RowsGemmConfig(128, 128, None, 8, 3),
         RowsGemmConfig(64, 128, 1, 4, 4), RowsGemmConfig(64, 128, 2, 4, 4), RowsGemmConfig(64, 128, 4, 4, 4),
         RowsGemmConfig(32, 128, 1, 4, 4), RowsGemmConfig(32, 128, 2, 4, 4), RowsGemmConfig(128, 64, 1, 8, 5),
         RowsGemmConfig(64, 256, None, 4, 3), RowsGemmConfig(128, 64, 2, 8, 4),
         # wide column tiles read x fewer times (x from L2 is as many bytes as qkv's weights at 64 rows)
         RowsGemmConfig(256, 64, 1, 8, 4), RowsGemmConfig(256, 64, 2, 8, 4), RowsGemmConfig(256, 64, 4, 8, 3),
         RowsGemmConfig(256, 64, 5, 8, 3), RowsGemmConfig(256, 128, 2, 8, 2), RowsGemmConfig(128, 64, 4, 8, 4),
         RowsGemmConfig(256, 64, None, 8, 4)]


def _weights(n: int, k: int, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(count)]


def products(rows: int, sweep: bool, bw: float, gen: torch.Generator) -> tuple[list[dict], dict]:
    """(one case per shape, the fastest rows_gemm config per shape)."""
    cases, best_configs = [], {}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        calls = max(2, -(-(512 << 20) // nbytes))
        ws = _weights(n, k, calls, gen)
        x = torch.randn(rows, k, generator=gen, device=DEV).bfloat16()
        want = F.linear(x, ws[0]).float()
        bound = 2e-2 * want.abs().max().item()
        case = dict(shape=name, n=n, k=k, rows_m=rows, calls=calls, weight_bytes=nbytes, rows={})
        case["rows"]["cublas"] = checked_us_in_graph(lambda i, x=x, ws=ws: F.linear(x, ws[i]), calls, want, bound, DEV)
        configs = [RowsGemmConfig(), *(SWEEP if sweep else [])]
        for cfg in configs:
            label = "default" if cfg == RowsGemmConfig() else f"{cfg.block_n}x{cfg.block_k} s{cfg.splits} " \
                                                              f"w{cfg.num_warps} st{cfg.num_stages}"
            case["rows"][label] = checked_us_in_graph(lambda i, x=x, ws=ws, cfg=cfg: rows_gemm(x, ws[i], config=cfg),
                                                      calls, want, bound, DEV)
        for row in case["rows"].values():
            if "us_per_call" in row:
                row["of_copy"] = nbytes / row["us_per_call"] / 1e6 * 1e12 / bw
        cases.append(case)
        timed = [(r["us_per_call"], lb, cfg) for (lb, r), cfg in zip(list(case["rows"].items())[1:], configs,
                                                                     strict=True) if "us_per_call" in r]
        best = min(timed, key=lambda t: t[0])
        best_configs[name] = best[2]
        cub = case["rows"]["cublas"].get("us_per_call", float("nan"))
        print(f"{name:13s} m={rows} cublas {cub:.2f} us, default {case['rows']['default'].get('us_per_call', -1):.2f}"
              f", best {best[0]:.2f} ({best[1]})", flush=True)
    return cases, best_configs


def layer(rows: int, gen: torch.Generator, configs: dict, layers: int = 4) -> dict:
    """Per layer us of the current batched route against the folded rows_gemm route (attention outside both), each
    product at `configs`' launch for its shape."""
    cq, co, cg, cd = (configs.get(s, RowsGemmConfig()) for s in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    hidden, inter, qkv_n = 4096, 14336, 6144
    wq, wo = _weights(qkv_n, hidden, layers, gen), _weights(hidden, hidden, layers, gen)
    wgu, wd = _weights(2 * inter, hidden, layers, gen), _weights(hidden, inter, layers, gen)
    ones = torch.ones(hidden, device=DEV, dtype=torch.bfloat16)
    attn_out = torch.randn(rows, hidden, generator=gen, device=DEV).bfloat16()
    stream0 = torch.randn(rows, hidden, generator=gen, device=DEV).bfloat16()
    delta0 = torch.randn(rows, hidden, generator=gen, device=DEV).bfloat16()
    state: dict[str, torch.Tensor] = {}

    def current(i: int) -> torch.Tensor:
        """fused add + norm, qkv, o_proj, add + norm, gate_up, SiLU-and-mul, down; returns the stream after it."""
        delta, res = (delta0, stream0) if i == 0 else (state["delta"], state["res"])
        h, res = fused_add_rms_norm(delta, res, ones, EPS)
        F.linear(h, wq[i])
        h2, res = fused_add_rms_norm(F.linear(attn_out, wo[i]), res, ones, EPS)
        state["delta"], state["res"] = F.linear(silu_and_mul(F.linear(h2, wgu[i])), wd[i]), res
        return res + state["delta"]

    stream = torch.empty_like(stream0)

    def folded(i: int) -> torch.Tensor:
        if i == 0:
            stream.copy_(stream0 + delta0)
        rows_gemm(stream, wq[i], rms_eps=EPS, config=cq)
        rows_gemm(attn_out, wo[i], add_to=stream, out=stream, config=co)
        act = rows_gemm(stream, wgu[i], gated=True, rms_eps=EPS, config=cg)
        rows_gemm(act, wd[i], add_to=stream, out=stream, config=cd)
        return stream

    want = current(0).float()
    bound = 3e-2 * want.abs().max().item()
    out = dict(rows_m=rows, layers=layers, configs={k: v.__dict__ for k, v in configs.items()},
               current=checked_us_in_graph(current, layers, want, bound, DEV),
               folded=checked_us_in_graph(folded, layers, want, bound, DEV))
    print(f"layer m={rows}: current {out['current'].get('us_per_call', -1):.2f} us, folded "
          f"{out['folded'].get('us_per_call', -1):.2f} us ({out['folded'].get('error', 'ok')})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", default="64")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-layer", action="store_true")
    args = parser.parse_args()
    bw = copy_bandwidth(DEV)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_tb_s=bw / 1e12, products=[], layer=[])
    gen = torch.Generator(DEV).manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        cases, best = products(rows, args.sweep, bw, gen)
        report["products"] += cases
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        if not args.no_layer:
            report["layer"].append(layer(rows, gen, best))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
