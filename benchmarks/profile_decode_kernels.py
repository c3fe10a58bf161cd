"""Kernels of a captured decode step (Llama-3.1-8B dummy, bf16) for any attention backend pair, ranked by time.

Why: FlashInfer decode costs 0.5-1.0 ms more a bs64 step than triton end to end although its per-call kernel is
faster (docs/benchmarks.md, session 11); the kernel tables of the two pairs side by side say where it goes.
  python3 benchmarks/profile_decode_kernels.py --batch-size 64 --decode-attention-backend flashinfer --page-size 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode_step import _kernel_table  # noqa: E402

from sglx.bench.one_batch import OneBatchConfig, _BatchRun, engine_config_for, make_prompts  # noqa: E402
from sglx.llm.engine_config import EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--prefill-attention-backend", default="triton")
    ap.add_argument("--decode-attention-backend", default="triton")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    from sglx.llm.model_runner import ModelRunner

    cfg = OneBatchConfig(batch_sizes=(args.batch_size,), input_len=args.input_len, output_len=64)
    base = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", page_size=args.page_size,
                        prefill_attention_backend=args.prefill_attention_backend,
                        decode_attention_backend=args.decode_attention_backend)
    runner = ModelRunner(engine_config_for(base, cfg))
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        run = _BatchRun(runner, make_prompts(runner.model_config.vocab_size, args.batch_size, args.input_len, 0), cfg)
        tokens = run.prefill()
        for step in range(10):
            tokens = run.decode(tokens, step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for step in range(10, 10 + args.steps):
                tokens = run.decode(tokens, step)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / args.steps
    rows = _kernel_table(prof, args.steps, args.top)
    label = f"{args.prefill_attention_backend}+{args.decode_attention_backend} page {args.page_size}"
    print(f"{label}, bs {args.batch_size}: {wall:.3f} ms/step profiled, {sum(r['us_per_step'] for r in rows):.0f} us "
          f"in the top {args.top}")
    for r in rows:
        print(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:4.0f}  {r['name'][:110]}")
    if args.output:
        Path(args.output).write_text(json.dumps(dict(label=label, wall_ms=wall, kernels=rows), indent=1))
    runner.release_memory()


if __name__ == "__main__":
    main()
