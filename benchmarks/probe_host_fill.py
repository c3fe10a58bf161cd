"""Host cost of ways to fill the decode graph's inputs: in a loop, and as the first call after a sync.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/probe_host_fill.py
A synchronised decode step (bench one-batch) leaves the GPU idle while the host fills the inputs, so
this host time is part of every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sglx.llm.cuda_graph_runner import DecodeInputBuffers


def loop_us(fn: Callable[[], object], n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def after_sync_us(fn: Callable[[], object], n: int = 50) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[n // 2] * 1e6


def main() -> None:
    dev = torch.device("cuda")
    buffers = DecodeInputBuffers(64, dev)
    srcs = [torch.arange(1, device=dev) for _ in range(5)]
    dsts = [row[:1] for row in buffers.packed]
    candidates: dict[str, Callable[[], object]] = {
        "foreach_copy": lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True),
        "5x copy_": lambda: [d.copy_(s, non_blocking=True) for d, s in zip(dsts, srcs)],
        "stack + copy": lambda: buffers.packed[:, :1].copy_(torch.stack(srcs)),
        "one fill_": lambda: buffers.packed[0, :1].fill_(0),
        "slicing only": lambda: [row[:1] for row in buffers.packed],
    }
    for name, fn in candidates.items():
        fn()
        print(f"{name:14s} loop {loop_us(fn):7.1f} us   first call after a sync {after_sync_us(fn):7.1f} us")


if __name__ == "__main__":
    main()
