"""The fused greedy MoE router at DeepSeek-V2-Lite's batch-1 decode shape, launch against launch, in CUDA graphs.

One token, hidden 2,048, 64 routed experts (top 6, softmax, not renormalised) + 2 shared, the post-attention add +
RMSNorm inside (`add_norm`) and one block per pair laid out for fused_moe (`align_block_m`), as the V2-Lite decode
step calls it. Every launch's outputs are checked against the default launch's first. us a call, from replays of a
graph of bench_moe_align's GRAPH_CALLS calls.

python benchmarks/bench_moe_router.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_moe_align import graph_ms  # benchmarks/ is on sys.path when a script there runs

from sglx.llm.kernels.fused_moe import moe_block_m
from sglx.llm.kernels.moe_router import greedy_router

LAUNCHES = [None, (1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 4), (8, 8), (16, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hidden, experts, k, shared = 2048, 64, 6, 2
    x = torch.randn(1, hidden, generator=gen).to(dev, dt)
    residual = torch.randn(1, hidden, generator=gen).to(dev, dt)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dt)
    gate = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(dev, dt)
    tickets = torch.zeros(4, dtype=torch.int32, device=dev)
    align = moe_block_m(k + shared, False)
    rows, ref = [], None
    for launch in LAUNCHES:
        def call(launch=launch):  # type: ignore[no-untyped-def]
            return greedy_router(x, gate, k, False, 1.0, tickets, shared=shared, align_block_m=align,
                                 add_norm=(residual, norm_w, 1e-6), launch=launch)
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"{launch}: failed {type(exc).__name__}: {str(exc)[:100]}")
            continue
        flat = [out[0], out[1], *out[2], *out[3]]
        if ref is None:
            ref = flat
        same = all(torch.equal(a, b) for a, b in zip(flat, ref))
        us = graph_ms(call) * 1e3
        name = "default" if launch is None else f"{launch[0]} experts, {launch[1]} warps"
        print(f"{name:24s} {us:6.2f} us  same as default: {same}")
        rows.append({"launch": name, "us": us, "same": same})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
