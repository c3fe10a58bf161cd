"""Triton MLA extend launch sweep at DeepSeek's expanded head dims (q/k 192, v 128): tile shapes, warps, stages, and
the 192-wide heads as two tiles (128 + 64) or one padded to 256.

One layer's extend as `bench_mla_prefill.py` times it (metadata, latent expansion, attention), each config's output
checked against the default launch's first. Prints ms per shape and config; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_mla_prefill import SHAPES, make_step, time_backend

from sglx.attention.kernels.extend_attention import ExtendConfig
from sglx.attention.llm import triton_mla

# (block_m, block_n, warps, stages) or None (the shipped launch), and whether the 192-wide heads run as 128 + 64
# (split, the default since session 31) or padded to 256; the first entry is the reference of the max_diff column
CONFIGS = [(None, False), (None, True), ((64, 64, 4, 2), True), ((64, 64, 4, 3), True), ((128, 32, 8, 2), True),
           ((128, 64, 8, 2), True), ((128, 64, 8, 3), True), ((64, 128, 4, 2), True), ((128, 128, 8, 2), True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    rows = []
    for shape, heads, new, prefix, bs in SHAPES:
        step = make_step(heads, new, prefix, bs, "cuda", torch.bfloat16)
        row = {"shape": shape, "ms": {}, "max_diff": {}}
        ref = None
        for cfg, split in CONFIGS:
            key = ("default" if cfg is None else "x".join(map(str, cfg))) + (" split" if split else " padded")
            config = (ExtendConfig(split_head=split) if cfg is None else
                      ExtendConfig(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3],
                                   split_head=split))
            triton_mla.TritonMLABackend.extend_config_override = config
            try:
                ms, out = time_backend("triton", step, "cuda", torch.bfloat16, args.reps, return_out=True)
            except Exception as exc:  # a launch that does not fit (shared memory) is reported, not fatal
                print(f"{shape:28s} {key:12s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if ref is None:
                ref = out
            row["ms"][key] = ms
            row["max_diff"][key] = (out.float() - ref.float()).abs().max().item()
            print(f"{shape:28s} {key:12s} {ms:8.3f} ms  diff {row['max_diff'][key]:.2e}")
        rows.append(row)
        del step
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
