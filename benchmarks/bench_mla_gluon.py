"""Triton MLA decode stage 1 (`tl.dot`) against its Gluon version and FlashInfer MLA, same run, alternated.

Each route is checked against float64 first (bench_mla_decode.measure); L2-flushed medians; both sglx routes run
through `mla_decode_attention` with `MLADecodeConfig(gluon=False / True)` and the backend's split policy.
Session 18 also timed a Gluon form that left each PV product in flight across the loop's back edge (ptxas C7515:
every wgmma serialised): 0.221 against 0.195 ms (benchmarks/results/s18/mla_gluon_pv_async_vs_sync_h200_s18.json).
`--routes gluon,seesaw` times the warp-specialised kernel (mla_decode_seesaw.py) too. Usage (GPU, SM90):

    PYTHONPATH=src python3 benchmarks/bench_mla_gluon.py --out $OUT/mla_gluon.json [--batches 64,4] [--pages 1,64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_mla_decode import DR, Case, R, flashinfer_row, measure

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention, mla_num_splits, resolve_config
from sglx.bench.timing import TimingBudget


def route(case: Case, gluon: bool, seesaw: bool = False):
    config = resolve_config(MLADecodeConfig(gluon=gluon, seesaw=seesaw), case.heads, case.pool.is_fp8, case.device)
    splits = mla_num_splits(case.batch, case.heads, case.context, num_sms(case.device), config)
    out = torch.empty(case.batch, case.heads, case.r, dtype=case.dtype, device=case.device)
    mid_o = torch.empty(case.batch, case.heads, splits, case.r, dtype=torch.float32, device=case.device)
    mid_lse = torch.empty(case.batch, case.heads, splits, dtype=torch.float32, device=case.device)
    kv = case.pool.kv_buffer[0]

    def run() -> torch.Tensor:
        return mla_decode_attention(case.q, kv, out, case.kv_indptr, case.kv_indices, mid_o, mid_lse, case.scale,
                                    case.r, kv_scale=case.pool.kv_scale[0], fp8_dtype=case.pool.fp8_dtype,
                                    config=config)
    return run, splits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,4")
    ap.add_argument("--pages", default="1,64")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto (bf16 latents), fp8_e4m3")
    ap.add_argument("--routes", default="triton,gluon", help="comma-separated: triton, gluon, seesaw")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    budget = TimingBudget()
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cases": []}
    for batch in (int(b) for b in args.batches.split(",")):
        for page, kv_dtype in ((int(p), k) for p in args.pages.split(",") for k in args.kv_cache_dtypes.split(",")):
            case = Case(batch, args.heads, args.context, page, torch.bfloat16, kv_dtype, device, R, DR)
            rows = [flashinfer_row(case, device, budget)]
            for _ in range(args.rounds):
                for name in args.routes.split(","):
                    fn, splits = route(case, name != "triton", name == "seesaw")
                    try:
                        rows.append({**measure(name, fn, case, budget), "splits": splits})
                    except Exception as exc:  # noqa: BLE001 - a failing route is a result
                        rows.append({"route": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
                    print(json.dumps(rows[-1]), flush=True)
            rows.append(flashinfer_row(case, device, budget))
            print(json.dumps(rows[-1]), flush=True)
            report["cases"].append({"batch": batch, "page": page, "kv_cache_dtype": kv_dtype, "heads": args.heads,
                                    "context": args.context, "rows": rows})
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
