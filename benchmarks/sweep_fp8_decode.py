"""fp8 (e4m3) KV decode launch variants vs the bf16 default, B=64, Hq 32 / Hkv 8, D 128, context 4096.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/sweep_fp8_decode.py --output sweep.json
Each variant is checked against SDPA on the dequantized cache before it is timed (do_bench median,
L2 flushed). Variants: BLOCK_N (wider tiles move as many bytes per iteration as bf16 does),
num_warps, num_stages and the number of KV splits; or, with `--converts ptx_v,ptx_kv,cast`, the default launch with
each fp8 conversion (DecodeConfig.fp8_convert) at the automatic split count, in two rounds (alternated).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_triton_decode import DEV, DIM, DTYPE, HKV, HQ, median_ms, paged_indices, sdpa_decode  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from sglx.attention.kernels.common import num_sms  # noqa: E402
from sglx.attention.kernels.decode_attention import DecodeConfig, choose_num_kv_splits, decode_attention  # noqa: E402
from sglx.attention.kernels.store_kv import store_kv  # noqa: E402

BS, CTX = 64, 4096
FP8 = torch.float8_e4m3fn
VARIANTS = [(None, None, None), (128, 4, 3), (64, 4, 4), (64, 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="sweep_fp8_decode.json")
    ap.add_argument("--converts", default="", help="comma-separated fp8_convert values to time instead of VARIANTS")
    ap.add_argument("--grid", default="", help="BLOCK_NxWARPSxSTAGES launches (e.g. 64x4x3,128x4x2) for fp8 instead "
                    "of VARIANTS, each at the --split-factors multiples of the automatic split count")
    ap.add_argument("--bf16-grid", default="", help="the same for the bf16 pool (default: its default launch only)")
    ap.add_argument("--pages", default="1,16")
    ap.add_argument("--split-factors", default="1,2", help="--grid launches run at these multiples of the automatic "
                    "split count (one- and two-warp programs need several splits to fill an SM)")
    args = ap.parse_args()
    converts = [c for c in args.converts.split(",") if c]
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid.split(",") if g] or VARIANTS
    bf16_grid = [tuple(int(x) for x in g.split("x")) for g in args.bf16_grid.split(",") if g]
    torch.manual_seed(0)
    k = torch.randn(BS, HKV, CTX, DIM, device=DEV, dtype=DTYPE)
    v = torch.randn(BS, HKV, CTX, DIM, device=DEV, dtype=DTYPE)
    q = torch.randn(BS, HQ, DIM, device=DEV, dtype=DTYPE)
    auto = choose_num_kv_splits(BS, HKV, CTX, num_sms(DEV))
    results: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, auto_splits=auto, rows=[])
    pages = [int(p) for p in args.pages.split(",")]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # the same-run baseline: cuDNN over contiguous bf16 K/V
        results["cudnn_contiguous_ms"] = median_ms(lambda: sdpa_decode(q, k, v))
    print("cudnn contiguous bf16", results["cudnn_contiguous_ms"], flush=True)
    for page in pages:
        kv_indptr, kv_indices, slots = paged_indices(BS, CTX, page, seed=page)
        loc = kv_indices.long()
        for fp8 in (None, FP8):
            store = torch.uint8 if fp8 is not None else DTYPE
            k_buf = torch.zeros(slots + page, HKV, DIM, device=DEV, dtype=store)
            v_buf = torch.zeros_like(k_buf)
            store_kv(k.transpose(1, 2).reshape(-1, HKV, DIM), v.transpose(1, 2).reshape(-1, HKV, DIM), k_buf, v_buf,
                     loc, fp8_dtype=fp8)

            def cache(buf: torch.Tensor, loc=loc, fp8=fp8) -> torch.Tensor:
                raw = buf[loc].view(fp8).to(DTYPE) if fp8 is not None else buf[loc]
                return raw.view(BS, CTX, HKV, DIM).transpose(1, 2).contiguous()

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = sdpa_decode(q, cache(k_buf), cache(v_buf))
            kv_bytes = 2 * BS * HKV * CTX * DIM * (1 if fp8 is not None else 2)
            variants = [(None, None, None, c) for c in converts * 2] if converts else \
                [(bn, nw, st, None) for bn, nw, st in grid]
            if fp8 is None:
                variants = [(None, None, None, None)] + [(bn, nw, st, None) for bn, nw, st in bf16_grid]
            for bn, nw, st, convert in variants:
                factors = [int(f) for f in args.split_factors.split(",")] if bn is not None else [1]
                for splits in [f * auto for f in factors]:
                    cfg = DecodeConfig(block_n=bn, num_warps=nw, num_stages=st,
                                       fp8_convert=convert if fp8 is not None else None)
                    out = torch.empty(BS, HQ, DIM, device=DEV, dtype=DTYPE)
                    mid_o = torch.empty(BS, HQ, splits, DIM, device=DEV)
                    mid_lse = torch.empty(BS, HQ, splits, device=DEV)

                    def run(cfg=cfg, out=out, mid_o=mid_o, mid_lse=mid_lse, k_buf=k_buf, v_buf=v_buf, fp8=fp8,
                            kv_indptr=kv_indptr, kv_indices=kv_indices):
                        decode_attention(q, k_buf, v_buf, out, kv_indptr, kv_indices, mid_o, mid_lse, DIM ** -0.5,
                                         fp8_dtype=fp8, config=cfg)
                    row = dict(page=page, kv="fp8_e4m3" if fp8 is not None else "bf16", block_n=bn, num_warps=nw,
                               num_stages=st, splits=splits, fp8_convert=cfg.fp8_convert)
                    try:
                        run()
                        row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                        row["ms"] = median_ms(run)
                        row["tb_per_s"] = kv_bytes / row["ms"] / 1e9
                    except Exception as exc:  # a config that fails to compile is recorded, not fatal
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    results["rows"].append(row)
                    print(row, flush=True)
            del k_buf, v_buf
            torch.cuda.empty_cache()
    for page in pages:
        bf16 = next(r["ms"] for r in results["rows"] if r["page"] == page and r["kv"] == "bf16")
        for r in results["rows"]:
            if r["page"] == page and "ms" in r:
                r["over_bf16_default"] = r["ms"] / bf16
    Path(args.output).write_text(json.dumps(results, indent=1))
    print("page kv block_n warps stages splits convert ms TB/s /bf16 err")
    for r in results["rows"]:
        if "ms" in r:
            print(r["page"], r["kv"], r["block_n"], r["num_warps"], r["num_stages"], r["splits"], r["fp8_convert"],
                  f"{r['ms']:.4f}",
                  f"{r['tb_per_s']:.2f}", f"{r['over_bf16_default']:.3f}", f"{r['max_abs_err']:.1e}")


if __name__ == "__main__":
    main()
