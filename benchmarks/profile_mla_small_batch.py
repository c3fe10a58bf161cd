"""Where a 128-head MLA decode call's time goes at each batch: stage 1 and the split merge as separate kernels.

Why: graph-timed calls (sweep_mla_small_batch.py) grow by about 2.2 us a 64-key tile a program from batch 16 to 32,
but batch 16's call (16 tiles a program) still takes about 80 us: a fixed part of ~45 us that the tile count does not
explain. torch.profiler over eager calls (each layer on its own latent buffer, as in the sweep) gives each kernel's
device time, so the fixed part splits into stage 1 and the merge. Usage (GPU):

    PYTHONPATH=src python3 benchmarks/profile_mla_small_batch.py --batches 1,4,16,32,64 --out $OUT/mla_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention, mla_num_splits, resolve_config

sys.path.insert(0, str(Path(__file__).parent))
from sweep_mla_small_batch import DR, R, flashinfer_call, random_case  # noqa: E402


def kernel_times(call, layers: int) -> dict:  # noqa: ANN001 - call(layer) launches one layer's decode
    """Median device time and launches a call of each kernel `call` runs, over 5 rounds of every layer."""
    for layer in range(layers):  # compile and warm
        call(layer)
    torch.cuda.synchronize()
    rounds = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for layer in range(layers):
                call(layer)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name].append(event.time_range.elapsed_us())
    return {name: dict(launches_per_call=len(t) / (rounds * layers), median_us=sorted(t)[len(t) // 2])
            for name, t in per_kernel.items()}


def profile_batch(batch: int, heads: int, context: int, layers: int, device: torch.device,
                  with_flashinfer: bool) -> dict:
    kv, kv_indices, kv_indptr, q, q_pe = random_case(batch, heads, context, layers, device)
    dt = q.dtype
    config = resolve_config(MLADecodeConfig(), heads, False, device)
    splits = mla_num_splits(batch, heads, context, num_sms(device), config)
    out = torch.empty(batch, heads, R, device=device, dtype=dt)
    mid_o = torch.empty(batch, heads, splits, R, device=device, dtype=torch.float32)
    mid_lse = torch.empty(batch, heads, splits, device=device, dtype=torch.float32)

    def call(layer: int) -> None:
        mla_decode_attention(q, kv[layer], out, kv_indptr, kv_indices, mid_o, mid_lse, (128 + 64) ** -0.5, R,
                             config=config, q_pe=q_pe)

    kernels = kernel_times(call, layers)
    fi: dict = {}
    if with_flashinfer:
        try:
            fi = kernel_times(flashinfer_call(q, q_pe, kv, kv_indptr, kv_indices, context, (128 + 64) ** -0.5), layers)
        except Exception as exc:  # noqa: BLE001 - a baseline that does not import is reported, not fatal
            fi = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    row = dict(batch=batch, heads=heads, context=context, splits=splits, kernels=kernels, flashinfer=fi,
               kv_bytes=batch * context * (R + DR) * 2,
               partial_bytes=batch * heads * splits * R * 4 if splits > 1 else 0)
    print(f"batch {batch}: splits {splits}", flush=True)
    for who, table in (("sglx", kernels), ("flashinfer", fi)):
        for name, k in table.items():
            if isinstance(k, dict):
                print(f"  {who:10s} {k['median_us']:8.2f} us  x{k['launches_per_call']:.0f}  {name[:80]}", flush=True)
            else:
                print(f"  {who:10s} {k}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's MLA kernels")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, rows=[])
    for batch in [int(b) for b in args.batches.split(",")]:
        report["rows"].append(profile_batch(batch, args.heads, args.context, args.layers, device,
                                             not args.no_flashinfer))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
