"""Where a batch-1 prefill's host time goes (cProfile), for a backend whose prefill is host-bound in one-batch.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/profile_prefill_host.py --attention-backend flashinfer
Llama-3.1-8B shapes, dummy bf16 weights, 512 prompt tokens (as `sglx bench one-batch`'s default input). Prints the
prefill's wall time (synchronized) and the functions with the most own and cumulative host time over --runs prefills.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from sglx.bench.one_batch import OneBatchConfig, _BatchRun, engine_config_for, make_prompts
from sglx.llm.engine_config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention-backend", default="flashinfer", help="'auto' leaves it to auto-selection")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from sglx.llm.model_runner import ModelRunner

    cfg = OneBatchConfig(batch_sizes=(1,), input_len=args.input_len, output_len=2)
    base = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16",
                        attention_backend=None if args.attention_backend == "auto" else args.attention_backend)
    runner = ModelRunner(engine_config_for(base, cfg))
    with torch.inference_mode():
        run = _BatchRun(runner, make_prompts(runner.model_config.vocab_size, 1, args.input_len, 0), cfg)
        for _ in range(3):
            run.prefill()
        times = []
        for _ in range(args.runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run.prefill()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"{args.attention_backend}: prefill {statistics.median(times):.2f} ms median of {times}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.runs):
            run.prefill()
        torch.cuda.synchronize()
        prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"--- by {key}, {args.runs} prefills", flush=True)
        print("\n".join(line[:200] for line in buf.getvalue().splitlines()[6:]), flush=True)
    runner.release_memory()


if __name__ == "__main__":
    main()
