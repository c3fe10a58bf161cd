"""Where one decode step's time goes: Llama-3.1-8B shapes, dummy bf16 weights, CUDA graphs, triton or another backend.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/profile_decode_step.py --output profile.json
It times (a) a whole step as `sglx bench one-batch` does (host clock, device synchronized), (b) the
graph replay alone with CUDA events, (c) the host time until `forward` returns, then profiles a few
steps with torch.profiler (CUDA activity): top kernels by total GPU time, GPU-busy time (union of
kernel intervals) against wall time per step. It also repeats the batch-1 prefill (fused kernels on
and off) to tell a slow kernel from a one-off in a single timed run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sglx.bench.one_batch import OneBatchConfig, _BatchRun, engine_config_for, make_prompts
from sglx.llm.engine_config import EngineConfig
from sglx.llm.kernels import fused_kernels


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _kernel_table(prof, steps: int, top: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = e.self_cuda_time_total
        if dev_us <= 0:
            continue
        rows.append(dict(name=e.key[:120], calls_per_step=e.count / steps, us_per_step=dev_us / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def _busy(trace_path: Path, steps: int) -> dict:
    """GPU-busy time (union of kernel/memcpy intervals) and first-kernel-to-last-kernel span per step."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    n_kernels = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return dict(gpu_busy_ms_per_step=busy / steps / 1e3, kernels_per_step=n_kernels / steps,
                first_to_last_kernel_ms=span / 1e3, steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="profile_decode_step.json")
    ap.add_argument("--trace", default=None, help="where to keep the chrome trace of the profiled steps")
    ap.add_argument("--attention-backend", default="triton", help="as the CLI's; 'auto' leaves it to auto-selection")
    ap.add_argument("--model-path", default="llama-3.1-8b", help="a shipped dummy config (deepseek-v2-lite, ...)")
    args = ap.parse_args()
    from sglx.llm.model_runner import ModelRunner

    cfg1 = OneBatchConfig(batch_sizes=(1,), input_len=512, output_len=64)
    base = EngineConfig(model_path=args.model_path, load_format="dummy", dtype="bfloat16",
                        attention_backend=None if args.attention_backend == "auto" else args.attention_backend)
    runner = ModelRunner(engine_config_for(base, cfg1))
    out: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     attention_backend=args.attention_backend)
    with torch.inference_mode():
        run = _BatchRun(runner, make_prompts(runner.model_config.vocab_size, 1, 512, 0), cfg1)
        tokens = run.prefill()
        for step in range(3):
            tokens = run.decode(tokens, step)
        torch.cuda.synchronize()

        # prefill, batch 1, 512 tokens: repeated (fused kernels on, then off; eager, no graphs in prefill)
        prefill = {}
        for label, on in (("fused", True), ("unfused", False)):
            with fused_kernels(on):
                run.prefill()
                times = [_median_ms(run.prefill, 1) for _ in range(10)]
            prefill[label] = dict(first_ms=times[0], median_ms=statistics.median(times), all_ms=times)
        out["prefill_bs1_512"] = prefill
        print("prefill bs1:", {k: round(v["median_ms"], 2) for k, v in prefill.items()}, flush=True)

        # decode step: whole step (as bench one-batch), host part, graph replay alone (CUDA events)
        gr = runner.graph_runner
        bucket = 1
        step_ms, host_ms = [], []
        for step in range(3, 33):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = run.decode(tokens, step)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            host_ms.append((t1 - t0) * 1e3)
        graph = gr.graphs[bucket]
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replay_ms = []
        for _ in range(30):
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            replay_ms.append(start.elapsed_time(stop))
        out["decode_bs1"] = dict(step_ms_median=statistics.median(step_ms), host_until_return_ms=statistics.median(
            host_ms), graph_replay_only_ms=statistics.median(replay_ms), replays=gr.replays)
        print("decode bs1:", out["decode_bs1"], flush=True)

        # host cost of each piece of a step, timed after a sync (the GPU idles while the host does these)
        pieces: dict[str, list[float]] = {k: [] for k in ("make_batch", "fill_inputs", "graph_replay_call",
                                                          "argmax_call", "sync_after_gpu")}
        for step in range(50, 60):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = run.decode_batch(tokens, step)
            t1 = time.perf_counter()
            gr.buffers.fill(batch, bucket, gr.fill_seq_len)
            t2 = time.perf_counter()
            graph.replay()
            t3 = time.perf_counter()
            tokens = gr.outputs[bucket][:1].argmax(-1)
            t4 = time.perf_counter()
            torch.cuda.synchronize()
            t5 = time.perf_counter()
            torch.cuda.synchronize()
            t6 = time.perf_counter()
            for key, dt in zip(pieces, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5), strict=True):
                pieces[key].append(dt * 1e3)
        out["decode_bs1_host_pieces_ms"] = {k: statistics.median(v) for k, v in pieces.items()}
        print("host pieces (ms):", {k: round(v, 4) for k, v in out["decode_bs1_host_pieces_ms"].items()}, flush=True)

        # profile 5 decode steps
        steps = 5
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for step in range(40, 40 + steps):
                tokens = run.decode(tokens, step)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / steps
        trace = Path(args.trace) if args.trace else Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(trace))
        out["profile_bs1"] = dict(wall_ms_per_step_profiled=wall, **_busy(trace, steps),
                                  top_kernels=_kernel_table(prof, steps, 25))
        p = out["profile_bs1"]
        print(f"profile bs1: wall {wall:.3f} ms/step, GPU busy {p['gpu_busy_ms_per_step']:.3f} ms/step, "
              f"{p['kernels_per_step']:.0f} kernels/step", flush=True)
        for r in p["top_kernels"]:
            print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:5.0f}  {r['name']}", flush=True)
        # the prefill's own kernels (fused on), to see a slow fused kernel at 512 tokens
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof2:
            t0 = time.perf_counter()
            run.prefill()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        trace2 = trace.with_name("trace_prefill.json")
        prof2.export_chrome_trace(str(trace2))
        # host-bound when GPU busy is far below wall
        busy = out["profile_prefill_bs1_busy"] = dict(wall_ms_profiled=wall, **_busy(trace2, 1))
        print(f"profile prefill bs1: wall {wall:.3f} ms, GPU busy {busy['gpu_busy_ms_per_step']:.3f} ms, "
              f"{busy['kernels_per_step']:.0f} kernels", flush=True)
        out["profile_prefill_bs1"] = _kernel_table(prof2, 1, 15)
        print("prefill kernels:", flush=True)
        for r in out["profile_prefill_bs1"]:
            print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:5.0f}  {r['name']}", flush=True)
    runner.release_memory()
    Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
