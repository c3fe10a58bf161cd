"""Launch sweep of sglx's fused MoE GEMMs at DeepSeek-V2-Lite's decode shapes, against the weight-read floor.

Issue 14: the batch-1 decode step of V2-Lite spends about 1.42 ms a step in the two expert GEMMs (27 layers less
the dense first one), against about 1.07 ms to read the chosen experts' weights at the H100's rated bandwidth.
Shapes: hidden 2048, expert width 1408, 64 routed experts (top 6) and 2 shared experts run as experts 64, 65 of
weight 1, as DeepseekMoE runs them; batches 1 and 32 (distinct random experts per token). Coordinate search: the
gate/up launch first (down at the default), then the down launch with the best gate/up; both GEMMs in one
persistent launch (`MoETiles.persistent`, the default tiles; not the engine's default: session 16) are timed right
after the default and again at the end, whatever budget is left. Each config is checked
against the default config's output (relative error <= 1e-2) before it is timed; medians with L2 flushed
(sglx.bench.timing); "floor" = the distinct experts' weight bytes / the device-to-device copy bandwidth (bytes read
and written per second, what a streaming kernel reaches) measured in the same run. (Session 15's recorded file,
sweep_fused_moe_h100_s15.json, divided by half of it: its floors are twice too high.) Usage (GPU):

    PYTHONPATH=src python3 benchmarks/sweep_fused_moe.py --out $OUT/sweep_fused_moe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

from sglx.bench.timing import TimingBudget, copy_bandwidth, median_ms
from sglx.llm.kernels.fused_moe import GemmLaunch, MoETiles, default_tiles, fused_moe, moe_align, work_entries

HIDDEN, INTER, ROUTED, TOP_K, SHARED = 2048, 1408, 64, 6, 2
SMEM_BYTES = 220 * 1024


def launches(gate_up: bool) -> list[GemmLaunch]:
    """Configs whose pipeline fits in shared memory (gate/up loads two weight tiles a step)."""
    out = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)):
        tile = bk * bn * 2 * (2 if gate_up else 1) + 16 * bk * 2
        if stages * tile <= SMEM_BYTES:
            out.append(GemmLaunch(bn, bk, warps, stages))
    return out


def make_case(tokens: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(tokens)
    dt = torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=device, dtype=dt, generator=gen)
    w13 = torch.randn(ROUTED, 2 * INTER, HIDDEN, device=device, dtype=dt, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(ROUTED, HIDDEN, INTER, device=device, dtype=dt, generator=gen) * INTER ** -0.5
    s13 = torch.randn(2 * SHARED * INTER, HIDDEN, device=device, dtype=dt, generator=gen) * HIDDEN ** -0.5
    s2 = torch.randn(HIDDEN, SHARED * INTER, device=device, dtype=dt, generator=gen) * INTER ** -0.5
    routed = torch.rand(tokens, ROUTED, device=device, generator=gen).argsort(dim=1)[:, :TOP_K]
    ids = torch.cat([routed, torch.arange(ROUTED, ROUTED + SHARED, device=device).expand(tokens, SHARED)], 1)
    weights = torch.cat([torch.rand(tokens, TOP_K, device=device, generator=gen),
                         torch.ones(tokens, SHARED, device=device)], 1)
    distinct = routed.unique().numel() + SHARED
    weight_bytes = distinct * 3 * INTER * HIDDEN * 2
    return x, w13, w2, (s13, s2), weights, ids.to(torch.int32), weight_bytes


def sweep(tokens: int, device: torch.device, copy_bw: float, deadline: float, budget: TimingBudget) -> dict:
    """One batch size: the default, the gate/up launches, the down launches, the best pair; its report entry."""
    x, w13, w2, shared, weights, ids, weight_bytes = make_case(tokens, device)
    pairs = ids.numel()
    base = default_tiles(pairs, False)
    aligned = moe_align(ids, ROUTED + SHARED, base.block_m)
    floor_ms = weight_bytes / copy_bw * 1e3

    work = torch.zeros(work_entries(aligned[1].numel()), dtype=torch.int32, device=device)  # the persistent launch's

    def run(tiles: MoETiles) -> torch.Tensor:
        return fused_moe(x, w13, w2, weights, ids, shared=shared, aligned=aligned, tiles=tiles, work=work)

    want = run(base).double()
    rows: list[dict] = []

    def measure(tiles: MoETiles, stage: str, always: bool = False) -> float:
        if time.time() > deadline and not always:
            return float("inf")
        row = dict(tokens=tokens, stage=stage, tiles=asdict(tiles), default=tiles == base)
        try:
            err = ((run(tiles).double() - want).norm() / want.norm()).item()
            row["rel_error"] = err
            if err > 1e-2:
                row["error"] = f"relative error {err:.3g} against the default config: not timed"
            else:
                t = median_ms(lambda: run(tiles), device, budget)
                row.update(ms=t.median_ms, x_floor=t.median_ms / floor_ms)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        return row.get("ms", float("inf"))

    # the default and the persistent launch (both GEMMs in one) first and again last, whatever the budget left
    measure(base, "default", always=True)
    persistent_ms = measure(replace(base, persistent=True), "persistent", always=True)
    best_up = min(launches(True), key=lambda g: measure(replace(base, gate_up=g), "gate_up"))
    best = replace(base, gate_up=best_up)
    best_down = min(launches(False), key=lambda g: measure(replace(best, down=g), "down"))
    best = replace(best, down=best_down)
    best_ms = measure(best, "best")
    base_ms = measure(base, "default_again", always=True)
    persistent_ms = min(persistent_ms, measure(replace(base, persistent=True), "persistent_again", always=True))
    print(f"tokens {tokens}: floor {floor_ms * 1e3:.1f} us; default {base_ms * 1e3:.1f} us "
          f"({base_ms / floor_ms:.2f}x); best {best_ms * 1e3:.1f} us ({best_ms / floor_ms:.2f}x) "
          f"gate_up {asdict(best_up)} down {asdict(best_down)}; persistent launch {persistent_ms * 1e3:.1f} us",
          flush=True)
    return dict(tokens=tokens, pairs=pairs, weight_bytes=weight_bytes, floor_ms=floor_ms, default=asdict(base),
                best=asdict(best), best_ms=best_ms, default_ms=base_ms, persistent_ms=persistent_ms, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--budget-s", type=float, default=360.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    deadline = time.time() + args.budget_s
    copy_bw = copy_bandwidth(device)
    report = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_gb_s=copy_bw / 1e9, cases=[])
    budget = TimingBudget(warmup_ms=10, rep_ms=60)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        report["cases"].append(sweep(tokens, device, copy_bw, deadline, budget))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
