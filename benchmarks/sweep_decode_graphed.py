"""sglx's Triton paged decode timed as a decode step runs it: one CUDA graph of one call per layer, each layer on its
own K/V buffers (no L2 reuse between calls), replayed; time per call = replay / layers.

Why: a Llama-3.1-8B decode step runs 32 decode launches back to back inside a graph. At batch 1 each takes about
8 us for 544 keys (latency, not bytes), at batch 64 about 55 us (1.3 TB/s of K/V reads). Earlier sweeps timed
single launches with events, which at these sizes measure launch noise as much as the kernel. The split count is
the engine's (`choose_num_kv_splits` for the graph's longest context, Llama-3.1's 131,072 by default) unless
--splits says otherwise; semaphores are passed as the triton backend passes them. Each config is checked against
SDPA (float32 math on the same K/V) first. Usage (GPU):

    PYTHONPATH=src python3 benchmarks/sweep_decode_graphed.py --cases 1:544,64:544 --page 128 \
        --sweep block_n=32,64 num_stages=2,3,4 --out $OUT/decode_graphed.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import triton

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.decode_attention import (
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
    semaphore_count,
)
from sglx.bench.timing import checked_us_in_graph

HQ, HKV, D = 32, 8, 128


def _field_value(name: str, text: str) -> object:
    kind = {f.name: f.type for f in fields(DecodeConfig)}[name]
    if "bool" in str(kind):
        return text.lower() in ("1", "true", "yes")
    if "float" in str(kind):
        return float(text)
    return int(text)


def run_case(bs: int, ctx: int, page: int, layers: int, graph_context: int, splits_arg: str,
             configs: list[DecodeConfig], device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(bs * 7 + ctx)
    dt = torch.bfloat16
    pages_per = -(-ctx // page)
    slots = (bs * pages_per + 1) * page
    k = torch.randn(layers, slots, HKV, D, device=device, dtype=dt, generator=gen)
    v = torch.randn(layers, slots, HKV, D, device=device, dtype=dt, generator=gen)
    order = torch.randperm(bs * pages_per, device=device, generator=gen) + 1  # page 0: padding
    kv_indices = ((order.view(bs, pages_per, 1) * page + torch.arange(page, device=device)).view(bs, -1)[:, :ctx]
                  .reshape(-1).int())
    kv_indptr = torch.arange(bs + 1, device=device, dtype=torch.int32) * ctx
    q = torch.randn(bs, HQ, D, device=device, dtype=dt, generator=gen)
    scale = D ** -0.5
    keys = k[0, kv_indices.long()].view(bs, ctx, HKV, D).float()
    values = v[0, kv_indices.long()].view(bs, ctx, HKV, D).float()
    qg = q.float().view(bs, HKV, HQ // HKV, D)
    att = torch.softmax(torch.einsum("bkgd,bskd->bkgs", qg, keys) * scale, -1)
    want = torch.einsum("bkgs,bskd->bkgd", att, values).reshape(bs, HQ, D)
    sms = num_sms(device)
    semaphores = torch.zeros(semaphore_count(bs, HQ, HKV), dtype=torch.int32, device=device)
    kv_bytes = bs * ctx * HKV * D * 2 * 2
    rows = []
    for config in configs:
        splits = (choose_num_kv_splits(bs, HKV, graph_context, sms, config) if splits_arg == "engine"
                  else int(splits_arg))
        out = torch.empty(bs, HQ, D, device=device, dtype=dt)
        mid_o = torch.empty(bs, HQ, splits, D, device=device, dtype=torch.float32)
        mid_lse = torch.empty(bs, HQ, splits, device=device, dtype=torch.float32)

        def call(layer: int, config=config, out=out, mid_o=mid_o, mid_lse=mid_lse) -> torch.Tensor:
            return decode_attention(q, k[layer], v[layer], out, kv_indptr, kv_indices, mid_o, mid_lse, scale,
                                    config=config, semaphores=semaphores, page_size=page)

        row: dict = dict(config=asdict(config), splits=splits, default=config == DecodeConfig())
        row.update(checked_us_in_graph(call, layers, want, 2e-2, device))
        if "us_per_call" in row:
            row["tb_per_s"] = kv_bytes / (row["us_per_call"] * 1e-6) / 1e12
        rows.append(row)
    timed = sorted((r for r in rows if "us_per_call" in r), key=lambda r: r["us_per_call"])
    default = next((r for r in rows if r["default"]), {})
    print(f"bs {bs} ctx {ctx} page {page}: default {default.get('us_per_call', float('nan')):.2f} us a call "
          f"({default.get('tb_per_s', float('nan')):.2f} TB/s), splits {default.get('splits')}", flush=True)
    changed = {f.name for f in fields(DecodeConfig)} - {"token_scale_fold", "fp8_convert"}
    for r in timed[:6]:
        diff = {n: r["config"][n] for n in changed if r["config"][n] != asdict(DecodeConfig())[n]}
        print(f"  {r['us_per_call']:.2f} us ({r['tb_per_s']:.2f} TB/s) splits {r['splits']} {diff}", flush=True)
    return dict(batch=bs, context=ctx, page=page, layers=layers, kv_bytes=kv_bytes, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1:544,64:544", help="batch:context pairs")
    parser.add_argument("--page", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--graph-context", type=int, default=131072)
    parser.add_argument("--splits", default="engine", help="'engine' (the backend's policy) or a number")
    parser.add_argument("--sweep", nargs="*", default=[], help="DecodeConfig fields, e.g. block_n=32,64")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configs = [DecodeConfig()]
    for item in args.sweep:
        name, _, values = item.partition("=")
        configs = [replace(c, **{name: _field_value(name, v)}) for c in configs for v in values.split(",")]
    if DecodeConfig() not in configs:
        configs.insert(0, DecodeConfig())
    device = torch.device("cuda")
    report = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), cases=[])
    for case in args.cases.split(","):
        bs, ctx = (int(x) for x in case.split(":"))
        report["cases"].append(run_case(bs, ctx, args.page, args.layers, args.graph_context, args.splits, configs,
                                        device))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
