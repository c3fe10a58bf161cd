"""Triton MLA decode launches at small batches, timed as a decode step runs them: one CUDA graph of one call per
layer, each layer on its own latent buffer (no L2 reuse between calls), replayed; time per call = replay / layers.

Why: the V2-Lite batch-1 step spends about 12 us a layer in MLA decode (stage 1 + merge) for 544 keys, and single
launches of a ~10 us kernel timed with events are dominated by launch noise (benchmarks/bench_mla_decode.py's
sweep at batch 1 spread 20-158 us for near-identical configs). Each config is checked against float64 first
(bf16 max abs error <= 3e-2). FlashInfer's MLA wrapper on the same pages is timed the same way (`flashinfer` in each
case: a CUDA-graph wrapper planned once outside the graph, `run` inside, as the flashinfer MLA backend captures
it), so small-batch ratios need no event-timed baseline. Usage (GPU):

    PYTHONPATH=src python3 benchmarks/sweep_mla_small_batch.py --out $OUT/mla_small_batch.json \
        --sweep min_chunk=16,32,64 block_n=16,32 num_stages=1,2 num_warps=2,4
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.mla_decode import (
    MLADecodeConfig,
    mla_decode_attention,
    mla_num_splits,
    resolve_config,
    split_chunk,
)
from sglx.bench.timing import checked_us_in_graph

R, DR = 512, 64


def flashinfer_call(q: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, context: int, scale: float) -> Callable[[int], torch.Tensor]:
    """call(layer): FlashInfer's BatchMLAPagedAttentionWrapper on layer `layer`'s latents (page size 1: a slot is a
    page), with the fixed index buffers a CUDA-graph wrapper needs, planned here, outside any graph."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch, heads, device = q.shape[0], q.shape[1], q.device
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, qo_indptr=qo_indptr.clone(),
                                            kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
                                            kv_len_arr=kv_lens.clone())
    wrapper.plan(qo_indptr.cpu(), kv_indptr.cpu(), kv_indices, kv_lens.cpu(), heads, R, DR, 1, False, scale, q.dtype,
                 kv.dtype)
    q_nope, q_rope = q.contiguous(), q_pe.contiguous()

    def call(layer: int) -> torch.Tensor:
        return wrapper.run(q_nope, q_rope, kv[layer][..., :R], kv[layer][..., R:])
    return call


def random_case(batch: int, heads: int, context: int, layers: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(kv [layers, slots, 1, R + DR], kv_indices, kv_indptr, q, q_pe): bf16, each request `context` keys on
    shuffled slots of every layer's own latent buffer (no L2 reuse between layers), seed 0."""
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    slots = batch * context + 1
    kv = torch.randn(layers, slots, 1, R + DR, device=device, dtype=dt, generator=gen)
    kv_indices = (torch.randperm(slots - 1, device=device, generator=gen) + 1).int()
    kv_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * context
    q = torch.randn(batch, heads, R, device=device, dtype=dt, generator=gen)
    q_pe = torch.randn(batch, heads, DR, device=device, dtype=dt, generator=gen)
    return kv, kv_indices, kv_indptr, q, q_pe


def run_case(batch: int, heads: int, context: int, layers: int, configs: list[MLADecodeConfig],
             device: torch.device, flashinfer: bool = True, partials: torch.dtype = torch.float32) -> dict:
    kv, kv_indices, kv_indptr, q, q_pe = random_case(batch, heads, context, layers, device)
    dt = q.dtype
    scale = (128 + 64) ** -0.5
    lat = kv[0, kv_indices.long(), 0].double().view(batch, context, R + DR)
    scores = torch.einsum("bhd,bld->bhl", torch.cat([q, q_pe], -1).double(), lat) * scale
    want = torch.softmax(scores, -1) @ lat[..., :R]
    rows = []
    for config in configs:
        resolved = resolve_config(config, heads, False, device)
        splits = mla_num_splits(batch, heads, context, num_sms(device), resolved)
        out = torch.empty(batch, heads, R, device=device, dtype=dt)
        mid_o = torch.empty(batch, heads, splits, R, device=device, dtype=partials)
        mid_lse = torch.empty(batch, heads, splits, device=device, dtype=torch.float32)

        def call(layer: int, resolved=resolved, out=out, mid_o=mid_o, mid_lse=mid_lse) -> torch.Tensor:
            return mla_decode_attention(q, kv[layer], out, kv_indptr, kv_indices, mid_o, mid_lse, scale, R,
                                        config=resolved, q_pe=q_pe)

        row: dict = dict(config=asdict(resolved), partials=str(partials), splits=splits,
                         chunk=split_chunk(resolved, batch, heads), default=config == MLADecodeConfig())
        row.update(checked_us_in_graph(call, layers, want, 3e-2, device))
        rows.append(row)
    timed = sorted((r for r in rows if "us_per_call" in r), key=lambda r: r["us_per_call"])
    default = next((r for r in rows if r["default"]), {})
    fi: dict = {}
    if flashinfer:
        try:
            fi = checked_us_in_graph(flashinfer_call(q, q_pe, kv, kv_indptr, kv_indices, context, scale), layers, want,
                                     3e-2, device)
        except Exception as exc:  # noqa: BLE001 - a baseline that does not import or plan is reported, not fatal
            fi = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    fi_text = f"{fi['us_per_call']:.2f} us" if "us_per_call" in fi else fi.get("error", "not run")
    print(f"batch {batch} heads {heads} context {context} {partials}: "
          f"default {default.get('us_per_call', float('nan')):.2f} us "
          f"a call, splits {default.get('splits')}; FlashInfer {fi_text}", flush=True)
    for r in timed[:6]:
        c = r["config"]
        print(f"  {r['us_per_call']:.2f} us  block_h {c['block_h']} block_n {c['block_n']} warps {c['num_warps']} "
              f"stages {c['num_stages']} split chunk {r['chunk']} splits {r['splits']}", flush=True)
    return dict(batch=batch, heads=heads, context=context, layers=layers, rows=rows, flashinfer=fi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--contexts", default="544,2048")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--sweep", nargs="*", default=[])
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's MLA row")
    parser.add_argument("--partials", default="float32", help="dtypes of the splits' partial outputs, each timed "
                        "(e.g. float32,bfloat16)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    configs = [MLADecodeConfig()]
    for item in args.sweep:
        field, _, values = item.partition("=")
        configs = [replace(c, **{field: int(v)}) for c in configs for v in values.split(",")]
    if MLADecodeConfig() not in configs:
        configs.insert(0, MLADecodeConfig())
    device = torch.device("cuda")
    report = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), cases=[])
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for i, partials in enumerate(p for p in args.partials.split(",") if p):
                report["cases"].append(run_case(batch, args.heads, context, args.layers, configs, device,
                                                not args.no_flashinfer and i == 0, getattr(torch, partials)))
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
