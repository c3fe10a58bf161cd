"""Batch-1 GEMVs with epilogues against the unfused kernels they replace, in CUDA graphs (Llama-3.1-8B shapes).

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_gemv_fused.py --out gemv_fused.json
Pairs: qkv + rotary + K/V store (gemv_rotary_store) against the GEMV then the rotary-and-store kernel; gate_up +
SiLU-and-mul (gemv_gated) against the GEMV then silu_and_mul. Each runs as a chain of calls over distinct weights (at
least 512 MB together, as bench_gemv.py does) in one CUDA graph, after its output is checked against the unfused
pair's; the plain GEMV alone is timed beside them. With the norm scale folded into the weight
(sglx.llm.layers.norm_folding): the norm kernel then the fused GEMV against the fused GEMV norming the unnormed row
itself (sum of squares in the loop or in a pass before it), and o_proj / down adding to the residual row in their
epilogue against the plain GEMV.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from sglx.attention.llm.kv_store import StepKVSlots
from sglx.bench.timing import checked_us_in_graph, copy_bandwidth
from sglx.llm.kernels.activation import silu_and_mul
from sglx.llm.kernels.gemv import GemvConfig, gemv
from sglx.llm.kernels.gemv_gated import gemv_gated
from sglx.llm.kernels.gemv_rotary import gemv_rotary_store
from sglx.llm.kernels.rotary import apply_rotary_and_store_
from sglx.llm.layers.rotary import RotaryEmbedding

DEV = torch.device("cuda")
HQ, HKV, D = 32, 8, 128
SHAPES = {"qkv + rotary + store": (6144, 4096), "gate_up + silu": (28672, 4096),
          "folded norm, qkv + rotary + store": (6144, 4096), "folded norm, gate_up + silu": (28672, 4096),
          "o_proj + residual add": (4096, 4096), "down + residual add": (4096, 14336)}
EPS = 1e-5
# launches of the kernels being introduced: without and with programmatic dependent launch (sglx.llm.kernels.pdl)
LAUNCHES = {"": GemvConfig(pdl=False), ", PDL": GemvConfig(pdl=True)}
Call = Callable[[int], torch.Tensor]


def _pairs(name: str, ws: list[torch.Tensor], gen: torch.Generator) -> dict[str, Call]:
    """label -> call(i) over weight i, the route being replaced first, then the fused kernels; each returns the
    step's output."""
    n, k = ws[0].shape
    x = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
    if name.startswith("folded"):
        return _folded_pairs(name, ws, x, gen)
    if name.endswith("residual add"):
        r = torch.randn(1, n, generator=gen, device=DEV).bfloat16()
        pairs = {"unfused": lambda i: gemv(x, ws[i], config=LAUNCHES[""])[0] + r}
        for tag, c in LAUNCHES.items():
            pairs[f"fused{tag}"] = lambda i, c=c: gemv(x, ws[i], add_to=r, config=c)[0]
        return pairs
    if name.startswith("gate_up"):
        return {"unfused": lambda i: silu_and_mul(gemv(x, ws[i])[0]), "fused": lambda i: gemv_gated(x, ws[i])}
    cos, sin = RotaryEmbedding(D, 500000.0, None, 8192).cos_sin(torch.tensor([600], device=DEV), torch.bfloat16)
    kb = torch.zeros(4096, HKV, D, device=DEV, dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    loc = torch.tensor([600], device=DEV)
    slots = StepKVSlots(kb, vb, loc, 1.0, 1.0, None)

    def unfused(i: int) -> torch.Tensor:
        q, kk, v = gemv(x, ws[i])[0].split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, kk = q.view(1, HQ, D), kk.view(1, HKV, D)
        apply_rotary_and_store_(q, kk, v.view(1, HKV, D), cos, sin, kb, vb, loc)
        return q[0]

    return {"unfused": unfused, "fused": lambda i: gemv_rotary_store(x, ws[i], None, cos, sin, HQ, HKV, slots)}


def _folded_pairs(name: str, ws: list[torch.Tensor], x: torch.Tensor, gen: torch.Generator) -> dict[str, Call]:
    """The norm kernel (scale g) then the fused GEMV over W, against the fused GEMV norming x itself over W with g
    folded in, launched each way of LAUNCHES."""
    from sglx.llm.kernels.rmsnorm import rms_norm

    k = x.shape[-1]
    g = (1 + 0.3 * torch.randn(k, generator=gen, device=DEV)).bfloat16()
    folded = [(w.float() * g.float()).bfloat16() for w in ws]
    if "gate_up" in name:
        pairs = {"norm + fused": lambda i: gemv_gated(rms_norm(x, g, EPS), ws[i], config=LAUNCHES[""])}
        for tag, c in LAUNCHES.items():
            pairs[f"folded{tag}"] = lambda i, c=c: gemv_gated(x, folded[i], config=c, rms_eps=EPS)
        return pairs
    cos, sin = RotaryEmbedding(D, 500000.0, None, 8192).cos_sin(torch.tensor([600], device=DEV), torch.bfloat16)
    kb = torch.zeros(4096, HKV, D, device=DEV, dtype=torch.bfloat16)
    slots = StepKVSlots(kb, torch.zeros_like(kb), torch.tensor([600], device=DEV), 1.0, 1.0, None)
    pairs = {"norm + fused": lambda i: gemv_rotary_store(rms_norm(x, g, EPS), ws[i], None, cos, sin, HQ, HKV, slots,
                                                         config=LAUNCHES[""])}
    for tag, c in LAUNCHES.items():
        pairs[f"folded{tag}"] = lambda i, c=c: gemv_rotary_store(x, folded[i], None, cos, sin, HQ, HKV, slots,
                                                                 config=c, rms_eps=EPS)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cases", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    bw = copy_bandwidth(DEV)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_tb_s=bw / 1e12, cases=[])
    gen = torch.Generator(DEV).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        if args.cases not in name:
            continue
        nbytes = n * k * 2
        calls = max(2, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(calls)]
        pairs = _pairs(name, ws, gen)
        want = next(iter(pairs.values()))(0).float()  # the first entry is the route being replaced
        case = dict(case=name, n=n, k=k, calls=calls, weight_bytes=nbytes, rows={})
        x0 = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
        plain = gemv(x0, ws[0])[0].float()
        case["rows"]["gemv alone"] = checked_us_in_graph(
            lambda i, x0=x0, ws=ws: gemv(x0, ws[i], config=LAUNCHES[""])[0], calls, plain, 1e-6, DEV)
        for label, call in pairs.items():
            row = checked_us_in_graph(call, calls, want, 2e-2 * want.abs().max().item(), DEV)
            if "us_per_call" in row:
                row["of_copy"] = nbytes / row["us_per_call"] / 1e6 * 1e12 / bw
            case["rows"][label] = row
        report["cases"].append(case)
        print(f"{name:22s} {n}x{k}: " + ", ".join(f"{lb} {row.get('us_per_call', float('nan')):.2f} us"
                                                   for lb, row in case["rows"].items()), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
