"""Where a batch-1 prefill's host time goes (cProfile): Llama-3.1-8B shapes, dummy bf16 weights, 512 tokens.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/profile_prefill_host.py [--attention-backend flashinfer]
Why: an eager bs1 prefill is host-bound (session 11, H100: GPU busy 11.6 ms, wall 20-44 ms); a backend with prefill
CUDA graphs (triton) replays instead (session 28, H200: flashinfer 20.2 ms wall, triton 12.8). Prints the prefill's
wall time (synchronized) and the functions with the most own and cumulative host time over --runs prefills.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from sglx.bench.one_batch import OneBatchConfig, _BatchRun, engine_config_for, make_prompts
from sglx.llm.engine_config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention-backend", default="flashinfer", help="'auto' leaves it to auto-selection")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--output", default=None, help="also write the printed text here")
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
    text = [f"{args.attention_backend}: prefill wall ms {times}"]
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
        text += [f"--- by {key}, {args.runs} prefills", *(line[:200] for line in buf.getvalue().splitlines()[6:])]
    print("\n".join(text[1:]), flush=True)
    if args.output:
        Path(args.output).write_text("\n".join(text) + "\n")
    runner.release_memory()


if __name__ == "__main__":
    main()
