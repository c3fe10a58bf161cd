"""moe_align's two launch shapes against a stable torch argsort, over DeepSeek routings and batch sizes.

Each row times one alignment three ways: eager (`triton.testing.do_bench`: what an eager prefill pays, launches
included) and as CUDA-graph replays of 20 calls (what a captured decode step pays). The one-program kernel is
skipped past 65,536 pairs (it walks every pair in one program: tens of ms). Every kernel's layout is checked against
the torch sort first. Usage: python benchmarks/bench_moe_align.py [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_align_reference import align_by_torch_sort, assert_same_alignment  # noqa: E402
from sglx.llm.kernels.fused_moe import moe_block_m  # noqa: E402
from sglx.llm.kernels.moe_align import moe_align  # noqa: E402

ROUTINGS = {"deepseek-v2-lite": (64, 6, 2), "deepseek-v3": (256, 8, 1)}  # routed experts, top-k, shared experts
TOKENS = (8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 32768)
GRAPH_CALLS = 20


def graph_ms(fn) -> float:
    """Median ms of one call, from replays of a graph of GRAPH_CALLS calls."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return tt.do_bench(graph.replay, warmup=10, rep=100) / GRAPH_CALLS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, (routed, top_k, shared) in ROUTINGS.items():
        experts = routed + shared
        for tokens in TOKENS:
            picks = torch.rand(tokens, routed, device="cuda").topk(top_k, dim=1).indices
            ids = torch.cat([picks, torch.arange(routed, experts, device="cuda").expand(tokens, shared)], 1)
            ids = ids.to(torch.int32)
            pairs = ids.numel()
            block_m = moe_block_m(pairs)
            want = align_by_torch_sort(ids, experts, block_m)
            row = {"routing": name, "experts": experts, "tokens": tokens, "pairs": pairs, "block_m": block_m}
            ways = {"three_launches": functools.partial(moe_align, ids, experts, block_m, one_program=False),
                    "torch_sort": functools.partial(align_by_torch_sort, ids, experts, block_m)}
            if pairs <= 65536:
                ways["one_program"] = functools.partial(moe_align, ids, experts, block_m, one_program=True)
            for way, fn in ways.items():
                if way != "torch_sort":
                    assert_same_alignment(fn(), want, block_m)
                row[f"{way}_eager_ms"] = round(tt.do_bench(fn, warmup=20, rep=100), 4)
                try:
                    row[f"{way}_graph_ms"] = round(graph_ms(fn), 4)
                except RuntimeError as exc:  # a torch op that cannot be captured
                    row[f"{way}_graph_ms"] = f"not capturable: {str(exc).splitlines()[0][:80]}"
            rows.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
