"""Does an L2 prefetch during idle HBM time make the next weight-streaming GEMM faster? (CUDA sm_90+)

    PYTHONPATH=src python3 benchmarks/probe_l2_prefetch.py --output probe_l2_prefetch.json

A CUDA graph of 32 "layers" of a batch-1 decode step, each: an idle window (`torch.cuda._sleep`, standing for
rotary + attention), the o_proj GEMV (4096x4096, sglx's skinny GEMM), a short idle window (a norm), the gate_up
GEMV (28672x4096, cuBLAS; it also pushes the previous layer's lines out of L2). Variants fork a side stream that
prefetches (`prefetch_l2` below) o_proj's weights, and optionally the first megabytes of gate_up's, at
the start of the window before each. Each layer has its own weights (7.5 GB in all), so nothing stays in L2 from
one replay to the next. Reported: replay time per layer (median of 30 replays) and the saving against no prefetch.

Session 14 (H100): 4 us a layer saved with a 10 us window, but in the Llama-3.1-8B engine (o_proj prefetched
after qkv in captured decode steps) batch 1 was slower in three alternated pairs of processes (6.49 / 6.59 / 6.54
ms against 6.29 / 6.46 / 6.34): the engine code was removed; docs/benchmarks.md "Session 14".
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglx.llm.kernels.skinny_gemm import skinny_linear

# a fire-and-forget L2 prefetch (sm_90+ `cp.async.bulk.prefetch.L2`): each lane issues one prefetch of CHUNK
# bytes; the instruction returns at once, so the kernel holds no registers for the data
CHUNK = 16 * 1024  # bytes per prefetch instruction (a multiple of 16)
LANES = 32  # prefetches per program (one warp)


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    live = offs < nbytes
    size = tl.where(live, tl.minimum(nbytes - offs, CHUNK), 16).to(tl.int32)
    addr = base + tl.where(live, offs, 0)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;", "=r,l,r",
        [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )


def prefetch_l2(t: torch.Tensor, max_bytes: int | None = None, chunk: int = CHUNK, lanes: int = LANES) -> None:
    """Start pulling the first `max_bytes` (None: all) of contiguous tensor `t` into L2 on the current stream."""
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes -= nbytes % 16
    if nbytes <= 0:
        return
    programs = triton.cdiv(triton.cdiv(nbytes, chunk), lanes)
    _l2_prefetch_kernel[(programs,)](t.data_ptr(), nbytes, CHUNK=chunk, LANES=lanes, num_warps=1)


LAYERS = 32
HIDDEN, INTER = 4096, 14336
MB = 1 << 20


def build_graph(wo, wgu, x, idle_cycles: int, norm_cycles: int, o_bytes: int | None, gu_bytes: int,
                chunk: int, lanes: int, side: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    def step() -> torch.Tensor:
        main = torch.cuda.current_stream()
        h = x
        forked = False
        for i in range(LAYERS):
            if o_bytes != 0:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch_l2(wo[i], o_bytes, chunk, lanes)
                forked = True
            torch.cuda._sleep(idle_cycles)
            y = skinny_linear(h, wo[i])
            if gu_bytes:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch_l2(wgu[i], gu_bytes, chunk, lanes)
                forked = True
            torch.cuda._sleep(norm_cycles)
            h = F.linear(y, wgu[i])[:, :HIDDEN]
        if forked:
            main.wait_stream(side)
        return h

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="probe_l2_prefetch.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    wo = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    wgu = [torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    # the prefetch changes no value: o_proj after a prefetch equals o_proj without
    ref = skinny_linear(x, wo[0])
    prefetch_l2(wo[0])
    torch.cuda.synchronize()
    assert torch.equal(ref, skinny_linear(x, wo[0]))
    clock_khz = torch.cuda.get_device_properties(dev).clock_rate if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1_980_000
    us = clock_khz // 1000  # cycles per microsecond
    variants = [
        # name, idle us before o_proj, norm us before gate_up, o_proj bytes (None: all, 0: none), gate_up bytes,
        # prefetch chunk bytes, lanes a program
        ("none, idle 10 us", 10, 3, 0, 0, 16384, 32),
        ("o_proj all, 16 KB x 32", 10, 3, None, 0, 16384, 32),
        ("o_proj all, 64 KB x 32", 10, 3, None, 0, 65536, 32),
        ("o_proj all, 4 KB x 128", 10, 3, None, 0, 4096, 128),
        ("o_proj all + gate_up 8 MB", 10, 3, None, 8 * MB, 16384, 32),
        ("o_proj all + gate_up 16 MB", 10, 3, None, 16 * MB, 16384, 32),
        ("o_proj 16 MB", 10, 3, 16 * MB, 0, 16384, 32),
        ("none, idle 5 us", 5, 3, 0, 0, 16384, 32),
        ("o_proj all, idle 5 us", 5, 3, None, 0, 16384, 32),
        ("none, idle 0", 0, 0, 0, 0, 16384, 32),
        ("o_proj all, idle 0", 0, 0, None, 0, 16384, 32),
        ("none, idle 10 us (again)", 10, 3, 0, 0, 16384, 32),
    ]
    rows = []
    base: dict[int, float] = {}
    for name, idle, norm, o_bytes, gu_bytes, chunk, lanes in variants:
        graph = build_graph(wo, wgu, x, idle * us, norm * us, o_bytes, gu_bytes, chunk, lanes, side)
        ms = time_graph(graph)
        if o_bytes == 0 and gu_bytes == 0:
            base.setdefault(idle, ms)
        per_layer_us = ms * 1000 / LAYERS
        saving = (base.get(idle, ms) - ms) * 1000 / LAYERS
        rows.append(dict(variant=name, idle_us=idle, norm_us=norm, o_bytes=o_bytes, gate_up_bytes=gu_bytes, chunk=chunk,
                         lanes=lanes, replay_ms=ms, per_layer_us=per_layer_us, saving_us_per_layer=saving))
        print(f"{name:34s} replay {ms:7.3f} ms  {per_layer_us:7.2f} us/layer  saving {saving:6.2f} us/layer",
              flush=True)
        del graph
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cycles_per_us=us, layers=LAYERS, rows=rows)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
