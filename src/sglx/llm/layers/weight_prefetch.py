"""Pull o_proj's weights into L2 while a small decode step's rotary and attention leave HBM idle.

Why: at batch 1 a decode step streams weights through its GEMMs at near copy bandwidth, and between the qkv
GEMM and o_proj the rotary and attention kernels (about 10 us a layer on an H100) read almost nothing from
HBM. Right after qkv is launched, a side stream issues bulk L2 prefetches of o_proj's weights
(sglx.llm.kernels.l2_prefetch), so o_proj reads part of them from L2. H100, a CUDA graph of 32 such layers
(benchmarks/probe_l2_prefetch.py): 4 us a layer saved with a 10 us window, 1.7 us with 5 us, and 7.7 us
LOST with no window; prefetching gate_up's first 8-16 MB during the following norm saved nothing more, and in
the 8B engine prefetching ahead of every GEMM made batch 64 slower. Hence: o_proj only, steps of at most
MAX_TOKENS tokens, only while a CUDA graph is captured (the fork costs nothing at replay, unlike on the host
of an eager step), on sm_90+ (the bulk-prefetch instruction). `SGLX_L2_PREFETCH=0` turns it off.
"""

from __future__ import annotations

import os

import torch

from sglx.llm.kernels import use_fused

ENV = "SGLX_L2_PREFETCH"
MAX_TOKENS = 16  # batch 64 measured no gain (attention there keeps HBM busy)


def prefetch_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class WeightPrefetcher:
    """One per model: `issue` right after launching the GEMM before the window, `join` before the forward ends."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = prefetch_enabled() if enabled is None else enabled
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: torch.cuda.Stream | None = None

    def _wanted(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.enabled and use_fused(x) and x.shape[0] <= MAX_TOKENS and weight.is_contiguous()
                and torch.cuda.is_current_stream_capturing()
                and torch.cuda.get_device_capability(x.device) >= (9, 0))

    def issue(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Prefetch `weight` into L2 beside the kernels that follow on x's stream (a no-op where not wanted)."""
        if not self._wanted(x, weight):
            return
        from sglx.llm.kernels.l2_prefetch import prefetch_l2

        main = torch.cuda.current_stream(x.device)
        side = self._streams.get(x.device)
        if side is None:
            side = self._streams[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch_l2(weight)
        self._pending = side

    def join(self) -> None:
        """The capturing stream waits for the side stream (a graph capture must end joined)."""
        if self._pending is not None:
            torch.cuda.current_stream(self._pending.device).wait_stream(self._pending)
            self._pending = None
