"""Decode attention at the contexts a one-batch run really has: split counts, the in-kernel split merge and TMA tiles.

Why: in the Llama-3.1-8B one-batch run at batch 64 (input 512, output 32: contexts 512-544) the decode kernels take
1.94 ms a step (stage 1 57 us a layer, stage 2 3.5 us) against 1.49 ms of KV reads at copy bandwidth, while the
4k-context bench shape runs at 93-95% of it. Under CUDA graphs the split count is sized for the graph's longest
context, so batch 64 runs 2 splits plus the stage-2 merge kernel whatever the context. This sweep times, on the
same paged KV (pages shuffled), the engine's launch against one split writing the output itself, the in-kernel
merge, and K/V tiles by TMA at page 128, with cuDNN on contiguous KV of the same shape in the same run.

    PYTHONPATH=src python3 benchmarks/sweep_decode_splits.py --out $OUT/sweep_decode_splits.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from bench_triton_decode import paged_indices, sdpa_decode  # noqa: E402

from sglx.attention.kernels.common import num_sms  # noqa: E402
from sglx.attention.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
    semaphore_count,
)

HQ, HKV, D = 32, 8, 128
GRAPH_CONTEXT = 131072  # Llama-3.1-8B's max context: what the CUDA-graph split count is sized for


def tile_variants() -> list[tuple[str, DecodeConfig, int, bool]]:
    """One split, tile shapes: with 3 stages of 64-key tiles (96 KB of shared memory) two programs fit an SM, so
    batch 64 x 8 KV heads runs in two waves; 32-key tiles fit four."""
    return [(f"1 split, block_n {bn}, {w} warps, {st} stages", DecodeConfig(block_n=bn, num_warps=w, num_stages=st),
             1, True) for bn, w, st in ((64, 4, 3), (32, 4, 3), (32, 4, 4), (32, 2, 3), (64, 4, 2), (64, 8, 3),
                                        (16, 4, 4), (32, 8, 4))]


def variants(bs: int, sms: int) -> list[tuple[str, DecodeConfig, int, bool]]:
    """(name, config, splits, semaphores passed)."""
    engine_splits = choose_num_kv_splits(bs, HKV, GRAPH_CONTEXT, sms)
    merged = DecodeConfig(merge_max_batch=1 << 20)
    return [
        (f"engine policy ({engine_splits} splits; stage 2 only above one split and batch 8)", DecodeConfig(),
         engine_splits, True),
        ("1 split, writes the output", merged, 1, True),
        ("2 splits, in-kernel merge", merged, 2, True),
        ("4 splits, in-kernel merge", merged, 4, True),
        ("4 splits, stage 2", DecodeConfig(), 4, False),
        ("1 split, block_n 128", replace(merged, block_n=128), 1, True),
        ("1 split, 4 stages", replace(merged, num_stages=4), 1, True),
        ("1 split, TMA block_n 64", replace(merged, tma=True), 1, True),
        ("1 split, TMA block_n 128", replace(merged, tma=True, block_n=128), 1, True),
        ("2 splits merged, TMA block_n 64", replace(merged, tma=True), 2, True),
    ]


def time_page(bs: int, ctx: int, page: int, sms: int, q, k, v, ref, cudnn_ms: float, dev: str,
              tiles: bool = False) -> dict:
    """Every variant on one paged copy of k/v, checked against cuDNN's output first."""
    kv_bytes = 2 * bs * HKV * ctx * D * 2
    kv_indptr, kv_indices, n_slots = paged_indices(bs, ctx, page, seed=ctx + page)  # pages shuffled, 0 is padding
    k_buf = torch.zeros(n_slots, HKV, D, device=dev, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    k_buf[kv_indices.long()] = k.permute(0, 2, 1, 3).reshape(-1, HKV, D)
    v_buf[kv_indices.long()] = v.permute(0, 2, 1, 3).reshape(-1, HKV, D)
    case = {"batch": bs, "context": ctx, "page": page, "cudnn_contiguous_ms": cudnn_ms,
            "cudnn_tb_s": kv_bytes / cudnn_ms / 1e9, "kv_bytes": kv_bytes, "variants": []}
    print(f"B{bs} ctx {ctx} page {page}: cuDNN contiguous {cudnn_ms * 1e3:.1f} us "
          f"({kv_bytes / cudnn_ms / 1e9:.2f} TB/s)", flush=True)
    for name, cfg, splits, sems in (tile_variants() if tiles else variants(bs, sms)):
        out = torch.empty(bs, HQ, D, device=dev, dtype=torch.bfloat16)
        mid_o = torch.empty(bs, HQ, splits, D, device=dev)
        mid_lse = torch.empty(bs, HQ, splits, device=dev)
        semaphores = torch.zeros(semaphore_count(bs, HQ, HKV), dtype=torch.int32, device=dev) if sems else None

        def call(cfg=cfg, out=out, mid_o=mid_o, mid_lse=mid_lse, sem=semaphores):
            return decode_attention(q, k_buf, v_buf, out, kv_indptr, kv_indices, mid_o, mid_lse, D ** -0.5,
                                    config=cfg, semaphores=sem, page_size=page)
        row: dict = {"name": name, "splits": splits,
                     "config": {key: val for key, val in cfg.__dict__.items() if val is not None}}
        try:
            err = (call().float() - ref).abs().max().item()
            row["max_abs_err_vs_cudnn"] = err
            if err > 2e-2:
                row["error"] = "wrong output"
            else:
                ms = do_bench(call, warmup=50, rep=300, return_mode="median")
                row.update(ms=ms, tb_s=kv_bytes / ms / 1e9, x_cudnn_time=ms / cudnn_ms)
        except Exception as exc:  # noqa: BLE001 - a launch that fails here is a result
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        case["variants"].append(row)
        print(f"  {name}: " + (f"{row['ms'] * 1e3:.1f} us {row['tb_s']:.2f} TB/s {row['x_cudnn_time']:.3f}x cuDNN "
                               "time" if "ms" in row else row["error"]), flush=True)
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", default="64,32")
    ap.add_argument("--contexts", default="544,1056,4096")
    ap.add_argument("--pages", default="128,1")
    ap.add_argument("--tiles", action="store_true", help="time one-split tile shapes instead of split policies")
    args = ap.parse_args()
    dev = "cuda"
    sms = num_sms(torch.device(dev))
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S"), "timing": "do_bench median, L2 flushed", "cases": []}
    for bs in (int(b) for b in args.batch.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            gen = torch.Generator(device=dev).manual_seed(ctx)
            k = torch.randn(bs, HKV, ctx, D, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(bs, HKV, ctx, D, device=dev, dtype=torch.bfloat16, generator=gen)
            q = torch.randn(bs, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = sdpa_decode(q, k, v).float()
                cudnn_ms = do_bench(lambda q=q, k=k, v=v: sdpa_decode(q, k, v), warmup=50, rep=300,
                                    return_mode="median")
            for page in (int(p) for p in args.pages.split(",")):
                results["cases"].append(time_page(bs, ctx, page, sms, q, k, v, ref, cudnn_ms, dev, args.tiles))
                torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
