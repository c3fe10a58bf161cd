"""Kernel timing shared by the benchmarks: median of many runs after warm-up, caches flushed in between.

On a GPU each run is bracketed by CUDA events and preceded by a write over a buffer larger than
the L2 cache (as triton.testing.do_bench does), so no run reads inputs a previous run left in L2;
the number of runs follows a time budget. On a CPU, wall-clock time of each run. Also the device
bandwidth that roofline floors are computed from, measured the same way as a device-to-device copy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2 (H100: 50 MB, B200: 126 MB)


@dataclass(frozen=True)
class Timing:
    """Median and spread (ms) of `runs` timed runs."""

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


@dataclass(frozen=True)
class TimingBudget:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_runs: int = 5
    max_runs: int = 1000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, budget: TimingBudget = TimingBudget()) -> Timing:
    """Time fn: warm-up for budget.warmup_ms, then as many runs as fit budget.rep_ms (within min/max runs)."""
    fn()
    _sync(device)
    if device.type == "cuda":
        return _cuda_median(fn, device, budget)
    started = time.perf_counter()
    fn()
    estimate = max((time.perf_counter() - started) * 1e3, 1e-3)
    for _ in range(int(budget.warmup_ms / estimate)):
        fn()
    runs = max(budget.min_runs, min(budget.max_runs, int(budget.rep_ms / estimate)))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(times), min(times), max(times), runs)


def _cuda_median(fn: Callable[[], object], device: torch.device, budget: TimingBudget) -> Timing:
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize(device)
    estimate = max(start.elapsed_time(end) / 5, 1e-3)  # includes the flush: a conservative estimate
    for _ in range(int(budget.warmup_ms / estimate)):
        fn()
    runs = max(budget.min_runs, min(budget.max_runs, int(budget.rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), min(times), max(times), runs)


def cuda_graphed(fn: Callable[[], T]) -> Callable[[], T]:
    """fn captured in a CUDA graph (after one warm-up call on a side stream, as capture wants); returns a replay that
    gives back the captured call's output (its tensors are rewritten by every replay).

    Why: kernels of a few microseconds launched one at a time are timed with their launch gaps; a decode step runs
    them back to back inside a graph, and so does the replay of a graph of several calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()

    def replay() -> T:
        graph.replay()
        return static
    return replay


def per_call_us_in_graph(call: Callable[[int], object], calls: int, device: torch.device,
                         budget: TimingBudget = TimingBudget(warmup_ms=20, rep_ms=150)) -> float:
    """Microseconds of one call(i) when call(0), ..., call(calls - 1) run back to back in one CUDA graph (give each i
    its own buffers, as each layer of a step has, so no call reads what the previous one left in L2)."""
    replay = cuda_graphed(lambda: [call(i) for i in range(calls)])
    return median_ms(replay, device, budget).median_ms * 1e3 / calls


def checked_us_in_graph(call: Callable[[int], torch.Tensor], calls: int, want: torch.Tensor, max_abs_error: float,
                        device: torch.device) -> dict:
    """A launch sweep's row fields for one config: `max_abs_error` of call(0) against `want` (compared in want's
    dtype), then `us_per_call` from `per_call_us_in_graph` only where that error is within the bound; a config that is
    wrong, fails to compile or to run gets `error` instead, so the sweep goes on."""
    row: dict = {}
    try:
        err = (call(0).to(want.dtype) - want).abs().max().item()
        row["max_abs_error"] = err
        if err > max_abs_error:
            row["error"] = f"max abs error {err:.3g}: not timed"
        else:
            row["us_per_call"] = per_call_us_in_graph(call, calls, device)
    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def copy_bandwidth(device: torch.device, nbytes: int | None = None, budget: TimingBudget = TimingBudget()) -> float:
    """Achieved bytes/s of a device-to-device copy (bytes read + bytes written per second).

    This is what a memory-bound kernel can hope for on this device right now; the rated peak is
    higher (H100 SXM: 3.35 TB/s rated, about 2.6-3.0 TB/s achieved by a copy).
    """
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = median_ms(lambda: dst.copy_(src), device, budget)
    return 2 * src.numel() * 4 / (timing.median_ms * 1e-3)
