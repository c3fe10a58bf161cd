"""Where overlap scheduling's time goes: the same offline batch with overlap on and off, under torch.profiler.

Sessions 10 and 11 measured overlap on at 0.83-0.90x of off in offline throughput on the H100 (issue 13), with no
cause. This runs the embedded model (or --model-path) on one batch of prompts twice per setting in one process
(a warm run, then a profiled one) and reports, per setting: wall time, output tokens, the GPU's busy time, and the
host calls that wait for the GPU (stream/event/device synchronizations, blocking copies) with their count and
total host time, plus the top host ops. A host that waits on the GPU in every step cannot overlap anything.

    PYTHONPATH=src python3 benchmarks/profile_overlap.py --output overlap_profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sglx.llm.embedded.task import MAX_PAIRS, make_example
from sglx.llm.engine import Engine

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
         "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::copy_")


def run(overlap: bool, prompts: list, params: dict, args) -> dict:
    """prompts: text, or token-id lists for a dummy model without a tokenizer (`--model-path`)."""
    kw = {"dtype": args.dtype if args.device == "cuda" else "float32", "page_size": 16, "max_total_tokens": 262144,
          "disable_overlap_schedule": not overlap, "attention_backend": args.attention_backend}
    if args.model_path:
        kw.update(model_path=args.model_path, load_format="dummy")
    with Engine(device=args.device, **kw) as eng:
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        def gen(batch: list) -> list:
            return eng.generate(input_ids=batch, sampling_params=params) if args.model_path else eng.generate(
                batch, params)
        gen(prompts[:64])  # warm: graphs, kernels
        sync()
        t0 = time.perf_counter()
        outs = gen(prompts)
        sync()
        plain_s = time.perf_counter() - t0
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            gen(prompts)
            sync()
            prof_s = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if getattr(e, "self_device_time_total", 0) > 0)
    waits = {e.key: {"count": e.count, "host_ms": round(e.cpu_time_total / 1e3, 2)} for e in events if e.key in WAITS}
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    return {"overlap": overlap, "wall_s": round(plain_s, 3), "tokens": tokens, "tok_s": round(tokens / plain_s),
            "profiled_wall_s": round(prof_s, 3), "gpu_busy_s": round(gpu_us / 1e6, 3), "waits": waits,
            "top_host_self": [{"name": e.key[:90], "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)}
                              for e in host]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", required=True)
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--model-path", default=None, help="a model to load with dummy weights (default: embedded)")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda", help="cpu: a logic check of this script (no GPU timings)")
    args = ap.parse_args()
    rng = random.Random(5)
    if args.model_path:  # dummy weights and no tokenizer: random ids, 128-384 tokens
        prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randint(128, 384))] for _ in range(args.num_prompts)]
    else:
        prompts = [make_example(rng, rng.randint(1, MAX_PAIRS))[0] for _ in range(args.num_prompts)]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "runs": []}
    for overlap in (True, False, True, False):
        r = run(overlap, prompts, params, args)
        result["runs"].append(r)
        keys = ("overlap", "wall_s", "tok_s", "profiled_wall_s", "gpu_busy_s")
        print(json.dumps({k: r[k] for k in keys}), flush=True)
        print("  waits:", json.dumps(r["waits"]), flush=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
