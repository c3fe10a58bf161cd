"""Batched-decode Llama layer without its two add + RMSNorm launches: is it faster? (issue 13 / 12, batch 64).

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/probe_batched_layer_routes.py --out probe.json

With the norm scales folded into qkv / gate_up (sglx.llm.layers.norm_folding), rmsnorm(h) W^T = rstd(h) * (h W'^T):
the products can read the raw residual stream h and the row scale 1 / rms(h) can be applied by the kernel that
reads their output (rotary, SiLU-and-mul), while o_proj / down add into h in place (cuBLAS with beta = 1, `addmm_`).
A layer then runs qkv, rotary, [attention], o_proj, gate_up, SiLU, down: two launches fewer than today's add + norm,
qkv, rotary, o_proj, add + norm, gate_up, SiLU, down. This probe times both chains over distinct weights in one CUDA
graph (attention left out: the same in both), the second with the row-scaled rotary and SiLU kernels (session 27's
first run stood today's kernels in for them: "stand-ins"), each product alone (F.linear, in-place addmm_, and the
swapped product W x^T) so cuBLAS's choices at these row counts are on record, and the small kernels alone with the
row-scaled SiLU's launches swept (`--small-only`: only those).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from sglx.bench.timing import per_call_us_in_graph
from sglx.llm.kernels import activation
from sglx.llm.kernels.activation import silu_and_mul
from sglx.llm.kernels.rmsnorm import fused_add_rms_norm
from sglx.llm.kernels.rotary import apply_rotary_and_store_

DEV = torch.device("cuda")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
EPS = 1e-5
LAYERS = 4
SILU_LAUNCHES = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 4), (1024, 8)]


def _weights(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16()
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [dict(qkv=w(qkv, HIDDEN), o=w(HIDDEN, HEADS * HEAD_DIM), gate_up=w(2 * INTER, HIDDEN),
                 down=w(HIDDEN, INTER)) for _ in range(LAYERS)]


def _case(rows: int, ws: list[dict[str, torch.Tensor]], gen: torch.Generator, small_only: bool) -> dict:
    """One row count: both layer chains, each product alone, the small kernels alone."""
    pool_k = torch.zeros(4096, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    pool_v = torch.zeros_like(pool_k)
    g = torch.ones(HIDDEN, device=DEV, dtype=torch.bfloat16)
    stream = torch.randn(rows, HIDDEN, generator=gen, device=DEV).bfloat16()
    delta = torch.randn(rows, HIDDEN, generator=gen, device=DEV).bfloat16()
    attn_out = torch.randn(rows, HEADS * HEAD_DIM, generator=gen, device=DEV).bfloat16()
    cos = torch.rand(rows, HEAD_DIM, generator=gen, device=DEV).bfloat16()
    sin = torch.rand(rows, HEAD_DIM, generator=gen, device=DEV).bfloat16()
    loc = torch.arange(rows, device=DEV, dtype=torch.int64)

    def rotary(qkv: torch.Tensor, rms_of: torch.Tensor | None = None) -> None:
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        apply_rotary_and_store_(q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM),
                                v.view(rows, KV_HEADS, HEAD_DIM), cos, sin, pool_k, pool_v, loc, rms_of=rms_of,
                                eps=EPS)

    def norm_kernels(i: int) -> torch.Tensor:  # today's route: add + norm kernels, products on normed rows
        w = ws[i]
        h, res = fused_add_rms_norm(delta, stream, g, EPS)
        rotary(F.linear(h, w["qkv"]))
        h2, res = fused_add_rms_norm(F.linear(attn_out, w["o"]), res, g, EPS)
        return F.linear(silu_and_mul(F.linear(h2, w["gate_up"])), w["down"])

    def post_scaled(i: int) -> torch.Tensor:  # products on the raw stream, residual adds by cuBLAS in place
        w = ws[i]
        rotary(F.linear(stream, w["qkv"]), rms_of=stream)
        stream.addmm_(attn_out, w["o"].t())
        return stream.addmm_(silu_and_mul(F.linear(stream, w["gate_up"]), rms_of=stream, eps=EPS), w["down"].t())

    case: dict = dict(rows=rows, layer_us={}, product_us={}, small_us={})
    gate_up = torch.randn(rows, 2 * INTER, generator=gen, device=DEV).bfloat16()
    qkv_out = torch.randn(rows, 6144, generator=gen, device=DEV).bfloat16()
    small = {"add + norm": lambda i: fused_add_rms_norm(delta, stream, g, EPS),
             "rotary + store": lambda i: rotary(qkv_out),
             "rotary + store, row-scaled": lambda i: rotary(qkv_out, rms_of=stream),
             "silu_and_mul": lambda i: silu_and_mul(gate_up)}
    for label, fn in small.items():
        case["small_us"][label] = per_call_us_in_graph(fn, LAYERS, DEV)
    default = (activation.SCALED_BLOCK, activation.SCALED_WARPS)
    for block, warps in SILU_LAUNCHES:
        activation.SCALED_BLOCK, activation.SCALED_WARPS = block, warps
        case["small_us"][f"silu_and_mul row-scaled {block}x{warps}"] = per_call_us_in_graph(
            lambda i: silu_and_mul(gate_up, rms_of=stream, eps=EPS), LAYERS, DEV)
    activation.SCALED_BLOCK, activation.SCALED_WARPS = default
    if small_only:
        return case
    for label, fn in (("norm kernels", norm_kernels), ("row-scaled", post_scaled),
                      ("norm kernels again", norm_kernels), ("row-scaled again", post_scaled)):
        case["layer_us"][label] = per_call_us_in_graph(fn, LAYERS, DEV)
    act = torch.randn(rows, INTER, generator=gen, device=DEV).bfloat16()
    inputs = dict(qkv=stream, o=attn_out, gate_up=stream, down=act)
    out = torch.empty(rows, HIDDEN, device=DEV, dtype=torch.bfloat16)
    for name, x in inputs.items():
        products = {"F.linear": lambda i, x=x, name=name: F.linear(x, ws[i][name]),
                    "swapped W x^T": lambda i, x=x, name=name: torch.mm(ws[i][name], x.t())}
        if name in ("o", "down"):
            products["addmm_ in place"] = lambda i, x=x, name=name: out.addmm_(x, ws[i][name].t())
        case["product_us"][name] = {lb: per_call_us_in_graph(fn, LAYERS, DEV) for lb, fn in products.items()}
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small-only", action="store_true", help="only the small kernels and the SiLU launch sweep")
    args = parser.parse_args()
    gen = torch.Generator(DEV).manual_seed(0)
    ws = _weights(gen)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), layers=LAYERS, cases=[])
    for rows in (int(r) for r in args.rows.split(",")):
        case = _case(rows, ws, gen, args.small_only)
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
