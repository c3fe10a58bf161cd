"""Where a dummy DeepSeek-V2-Lite decode step goes, on the lent GPU, in one process.

1. The routed experts of one MoE layer alone (64 experts, top 6, hidden 2048, expert width 1408, bf16), per
   implementation: sglx's fused Triton MoE, torch's grouped GEMM (`torch._grouped_mm`) and the per-expert loop;
   the first two replayed from CUDA graphs, each checked against the loop first; floor = the touched experts'
   bytes / device copy bandwidth.
2. `sglx bench one-batch`'s measurement (same code) for batch sizes 1 and 32 (`--batch-sizes`) on one loaded
   runner, then a torch.profiler table of a few graph-replayed decode steps per size: where the step's time goes.

    PYTHONPATH=src python3 benchmarks/bench_deepseek_step.py --out $OUT/deepseek_step.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from sglx.bench.one_batch import OneBatchConfig, _BatchRun, _one_size, engine_config_for, make_prompts
from sglx.bench.timing import TimingBudget, copy_bandwidth, cuda_graphed, median_ms
from sglx.llm.engine_config import EngineConfig
from sglx.llm.layers.moe import RoutedExperts


def moe_layer(bandwidth: float, token_counts: list[int]) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    e, k, h, i = 64, 6, 2048, 1408
    experts = RoutedExperts(e, h, i).to(dev, torch.bfloat16)
    experts.w13.data = torch.randn(e, 2 * i, h, generator=gen, device=dev).mul_(h ** -0.5).bfloat16()
    experts.w2.data = torch.randn(e, h, i, generator=gen, device=dev).mul_(i ** -0.5).bfloat16()
    expert_bytes = 3 * h * i * 2
    rows = []
    for t in token_counts:
        x = torch.randn(t, h, generator=gen, device=dev).bfloat16()
        weights, ids = torch.topk(torch.rand(t, e, generator=gen, device=dev), k, dim=-1)
        touched = ids.unique().numel()
        floor_ms = touched * expert_bytes / bandwidth * 1e3
        loop = experts.forward_loop(x, weights, ids).float()
        row: dict = {"tokens": t, "experts_touched": touched, "floor_ms": floor_ms}
        for name, fn in (("fused_triton", experts.forward_fused), ("torch_grouped_mm", experts.forward_grouped),
                         ("per_expert_loop", experts.forward_loop)):
            try:
                out = fn(x, weights, ids).float()
                err = ((out - loop).abs().max() / loop.abs().max()).item()
                call = functools.partial(fn, x, weights, ids)
                runner = call if name == "per_expert_loop" else cuda_graphed(call)
                ms = median_ms(runner, dev, TimingBudget(warmup_ms=10, rep_ms=60)).median_ms
                row[name] = {"ms": ms, "ratio_to_floor": ms / floor_ms, "max_rel_error_vs_loop": err,
                             "graphed": name != "per_expert_loop"}
            except Exception as exc:  # noqa: BLE001 - a path that fails is reported
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _kernel_table(prof, steps: int, top: int) -> list[dict]:
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) or 0
        if dev_us > 0:
            rows.append(dict(name=ev.key[:100], calls_per_step=ev.count / steps, us_per_step=dev_us / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def one_batch_and_profile(batch_sizes: tuple[int, ...], bandwidth: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from sglx.llm.model_runner import ModelRunner

    config = OneBatchConfig(batch_sizes=batch_sizes, input_len=512, output_len=32)
    base = EngineConfig(model_path="deepseek-v2-lite", load_format="dummy", dtype="bfloat16",
                        attention_backend="triton", device="cuda", max_total_tokens=65536)
    runner = ModelRunner(engine_config_for(base, config))
    out: dict = {"engine": runner.describe(), "results": [], "profiles": {}}
    try:
        with torch.inference_mode():
            for bs in batch_sizes:
                res = _one_size(runner, config, bs, 0, bandwidth)
                res.pop("output_ids", None)
                out["results"].append(res)
                print(f"one-batch bs={bs}: step {res['decode_step_ms_median']:.3f} ms, floor {res['floor_ms']:.3f} ms,"
                      f" ratio {res['ratio_to_floor']:.2f}x, device {res['decode_step_device_ms_median']:.3f} ms",
                      flush=True)
                run = _BatchRun(runner, make_prompts(runner.model_config.vocab_size, bs, 512, 1), config)
                tokens = run.prefill()
                for step in range(3):
                    tokens = run.decode(tokens, step)
                torch.cuda.synchronize()
                steps = 3
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for step in range(3, 3 + steps):
                        tokens = run.decode(tokens, step)
                    torch.cuda.synchronize()
                table = _kernel_table(prof, steps, 18)
                total = sum(r["us_per_step"] for r in _kernel_table(prof, steps, 10_000))
                out["profiles"][bs] = {"kernel_us_per_step": total, "top": table}
                print(f"  kernels {total / 1e3:.3f} ms/step; top:", flush=True)
                for r in table:
                    print(f"  {r['us_per_step']:9.1f} us x{r['calls_per_step']:5.0f} {r['name']}", flush=True)
    finally:
        runner.release_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated one-batch sizes to time and profile")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    report: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                    "copy_bandwidth_gb_per_s": bandwidth / 1e9}
    report["moe_layer"] = moe_layer(bandwidth, [1, 8, 32, 256])
    if not args.skip_model:
        report["model"] = one_batch_and_profile(tuple(int(b) for b in args.batch_sizes.split(",")), bandwidth)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("MoE layer (ms; ratio to floor):")
    for row in report["moe_layer"]:
        cells = [f"{n}={row[n]['ms']:.4f}({row[n]['ratio_to_floor']:.1f}x)" if "ms" in row[n] else f"{n}=ERR"
                 for n in ("fused_triton", "torch_grouped_mm", "per_expert_loop")]
        print(f"  T={row['tokens']:4d} floor {row['floor_ms']:.4f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
