"""Does cuBLAS's batch-64 qkv product fill the GPU better as K halves on parallel graph branches? (issue 13 / 12)

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/probe_split_k_streams.py --out probe.json

Why: at 64 rows cuBLAS runs Llama-3.1-8B's qkv (6144x4096) as 64x64 tiles, 96 programs on 132 SMs, at about 70% of
the copy bandwidth (session 26 profile), and nothing else runs beside it. Split over K into parts on their own
streams (captured as parallel branches of one CUDA graph), each part has the same 96 tiles over a shorter K, so the
GPU holds twice (or four times) the programs; the partial products would then be summed by the rotary kernel that
reads qkv anyway. This times the products alone (partials left apart; the sum's cost is not in these rows), over
four layers of distinct weights a graph, against F.linear on the whole K.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from sglx.bench.timing import median_ms

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
LAYERS = 4


def _graph_us(fn, streams: list[torch.cuda.Stream]) -> float:  # noqa: ANN001
    """us a layer of fn(i) for i in range(LAYERS), captured in one graph (side streams forked and joined)."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    for i in range(LAYERS):
        fn(i)
    for s in streams:
        main.wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    return median_ms(graph.replay, DEV).median_ms * 1e3 / LAYERS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(DEV).manual_seed(0)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=args.rows, cases={})
    streams = [torch.cuda.Stream() for _ in range(4)]
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(LAYERS)]
        x = torch.randn(args.rows, k, generator=gen, device=DEV).bfloat16()
        want = (x.double() @ ws[0].double().t()).float()
        rows: dict = {"F.linear": _graph_us(lambda i, ws=ws, x=x: F.linear(x, ws[i]), [])}
        for parts in (2, 4):
            width = k // parts
            outs = [[torch.empty(args.rows, n, device=DEV, dtype=torch.bfloat16) for _ in range(parts)]
                    for _ in range(LAYERS)]

            def split(i: int, parts=parts, width=width, outs=outs, ws=ws, x=x) -> None:
                main = torch.cuda.current_stream()
                for p in range(parts):
                    s = streams[p]
                    s.wait_stream(main)
                    with torch.cuda.stream(s):
                        torch.mm(x[:, p * width:(p + 1) * width], ws[i][:, p * width:(p + 1) * width].t(),
                                 out=outs[i][p])
                for p in range(parts):
                    main.wait_stream(streams[p])

            split(0)
            torch.cuda.synchronize()
            got = sum(o.float() for o in outs[0])
            rows[f"{parts} K parts on parallel branches"] = _graph_us(split, streams[:parts])
            rows[f"{parts} K parts max abs error"] = (got - want).abs().max().item()
        report["cases"][name] = rows
        print(name, {lb: round(v, 3) for lb, v in rows.items()}, flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
