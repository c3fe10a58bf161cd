"""Host-side profile (cProfile) of one bs1 prefill of 512 tokens, Llama-3.1-8B dummy, triton.

Why: bs1 prefill is host-bound on the H100 (GPU busy 11.6 ms, wall 20-44 ms); this says which Python
frames the wall goes to, and how wall changes with synchronize-free repetition.
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
    ap.add_argument("--output", default="profile_prefill_host.txt")
    args = ap.parse_args()
    from sglx.llm.model_runner import ModelRunner

    cfg1 = OneBatchConfig(batch_sizes=(1,), input_len=512, output_len=8)
    base = EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16", attention_backend="triton")
    runner = ModelRunner(engine_config_for(base, cfg1))
    with torch.inference_mode():
        run = _BatchRun(runner, make_prompts(runner.model_config.vocab_size, 1, 512, 0), cfg1)
        for _ in range(3):
            run.prefill()
        torch.cuda.synchronize()
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run.prefill()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        print("prefill wall ms:", [round(w, 2) for w in walls], "median", round(statistics.median(walls), 2))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            run.prefill()
            torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s).sort_stats("tottime")
    st.print_stats(45)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(45)
    text = s.getvalue() + "\n\n=== cumulative ===\n" + s2.getvalue()
    Path(args.output).write_text(text)
    print(text[:12000])


if __name__ == "__main__":
    main()
