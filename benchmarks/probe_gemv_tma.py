"""Probe: does a batch-1 GEMV that streams its weight tiles by TMA (descriptor loads pipelined through shared memory)
beat sglx's GEMV (vector loads into registers) at Llama-3.1-8B shapes? Timed in CUDA graphs over distinct weights.

Run on a CUDA GPU (sm_90+):  PYTHONPATH=src python3 benchmarks/probe_gemv_tma.py --out probe.json
Variants: a grid of one program per row block (as the shipped GEMV), and a persistent grid whose programs walk a
contiguous run of row blocks in one flattened (row block, K step) loop, so the TMA pipeline never drains between
row blocks. Both with programmatic dependent launch, as the shipped GEMV launches in a step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sglx.bench.timing import checked_us_in_graph, copy_bandwidth
from sglx.llm.kernels.gemv import GemvConfig, gemv
from sglx.llm.kernels.gemv_gated import gemv_gated
from sglx.llm.kernels.pdl import pdl_prologue

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _gemv_tma_kernel(X, W_desc, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     STAGES: tl.constexpr):
    pdl_prologue(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = W_desc.load([n0, k0])
        x = tl.load(X + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    offs = n0 + tl.arange(0, BLOCK_N)
    tl.store(Y + offs, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=offs < N)


@triton.jit
def _gemv_tma_persistent_kernel(X, W_desc, Y, N, K, row_blocks, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                PDL: tl.constexpr, STAGES: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    per = row_blocks // progs
    extra = row_blocks % progs
    first = pid * per + tl.minimum(pid, extra)
    count = per + (pid < extra).to(tl.int32)
    k_steps = K // BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in tl.range(0, count * k_steps, num_stages=STAGES):
        rb = first + t // k_steps
        kb = t % k_steps
        w = W_desc.load([rb * BLOCK_N, kb * BLOCK_K])
        x = tl.load(X + kb * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if kb == k_steps - 1:
            offs = rb * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(Y + offs, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=offs < N)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


def gemv_tma(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, stages: int, warps: int,
             persistent: int = 0, pdl: bool = True) -> torch.Tensor:
    """x [1, K] @ w^T; persistent: programs an SM (0: one program a row block)."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [block_n, block_k])
    extra = {"launch_pdl": True} if pdl else {}
    if persistent:
        row_blocks = triton.cdiv(n, block_n)
        progs = min(row_blocks, persistent * torch.cuda.get_device_properties(x.device).multi_processor_count)
        _gemv_tma_persistent_kernel[(progs,)](x, desc, y, n, k, row_blocks, BLOCK_N=block_n, BLOCK_K=block_k,
                                              PDL=pdl, STAGES=stages, num_warps=warps, num_stages=stages, **extra)
    else:
        _gemv_tma_kernel[(triton.cdiv(n, block_n),)](x, desc, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                                     STAGES=stages, num_warps=warps, num_stages=stages, **extra)
    return y


# (block_n, block_k, stages, warps, persistent programs an SM)
VARIANTS = [(8, 256, 4, 4, 0), (8, 256, 6, 4, 0), (16, 256, 4, 4, 0), (16, 128, 6, 4, 0), (8, 128, 8, 4, 0),
            (32, 128, 4, 4, 0), (16, 256, 4, 8, 0),
            (8, 256, 6, 4, 2), (16, 256, 6, 4, 2), (16, 256, 8, 4, 1), (32, 256, 4, 8, 1), (16, 128, 8, 4, 4),
            (8, 256, 8, 4, 4), (32, 128, 6, 4, 2)]


GATED = [(8, 256, 4, 4), (8, 256, 3, 4), (16, 256, 3, 4), (8, 256, 4, 8), (16, 128, 4, 4), (4, 256, 4, 4),
         (8, 256, 2, 4), (8, 128, 4, 4), (8, 128, 6, 4), (4, 256, 3, 4), (8, 256, 3, 2), (4, 256, 3, 2)]


def gated(gen: torch.Generator, bw: float) -> dict:
    """The gate_up GEMV with SiLU and the folded norm (gemv_gated, PDL): its vector loads against its TMA route."""
    n, k = 28672, 4096
    calls = max(2, -(-(512 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(calls)]
    x = torch.randn(1, k, generator=gen, device=DEV).mul_(3).bfloat16()
    want = gemv_gated(x, ws[0], rms_eps=1e-5, config=GemvConfig(pdl=False, tma=False)).float()
    bound = 1e-2 * want.abs().max().item()
    rows = {"gemv_gated folded, PDL, vector loads": checked_us_in_graph(
        lambda i: gemv_gated(x, ws[i], rms_eps=1e-5, config=GemvConfig(pdl=True, tma=False)), calls, want, bound,
        DEV)}
    for v in GATED:
        bp, bk, st, w = v  # the shipped TMA kernel (gemv_gated's route) at each launch
        cfg = GemvConfig(block_n=2 * bp, block_k=bk, num_warps=w, num_stages=st, pdl=True, tma=True)
        rows["tma gated {}x{} st{} w{}".format(*v)] = checked_us_in_graph(
            lambda i, cfg=cfg: gemv_gated(x, ws[i], rms_eps=1e-5, config=cfg), calls, want, bound, DEV)
    for row in rows.values():
        if "us_per_call" in row:
            row["of_copy"] = n * k * 2 / row["us_per_call"] / 1e6 * 1e12 / bw
    print("gated:", {lb: round(r.get("us_per_call", -1), 2) for lb, r in rows.items()}, flush=True)
    return dict(shape="gate_up + silu, folded norm", n=n, k=k, calls=calls, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gated-only", action="store_true")
    args = parser.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEV))
    bw = copy_bandwidth(DEV)
    report: dict = dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_tb_s=bw / 1e12, cases=[])
    gen = torch.Generator(DEV).manual_seed(0)
    report["cases"].append(gated(gen, bw))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    for name, (n, k) in ({} if args.gated_only else SHAPES).items():
        nbytes = n * k * 2
        calls = max(2, -(-(512 << 20) // nbytes))
        ws = [torch.randn(n, k, generator=gen, device=DEV).mul_(k ** -0.5).bfloat16() for _ in range(calls)]
        x = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
        want = gemv(x, ws[0], config=GemvConfig(pdl=False))[0].float()  # the plain GEMV has no TMA route
        bound = 1e-2 * want.abs().max().item()
        rows = {f"gemv{tag}": checked_us_in_graph(lambda i, x=x, ws=ws, c=c: gemv(x, ws[i], config=c)[0], calls, want,
                                                  bound, DEV)
                for tag, c in (("", GemvConfig(pdl=False)), (", PDL", GemvConfig(pdl=True)))}
        for v in VARIANTS:
            label = "tma {}x{} st{} w{}".format(*v[:4]) + (f" persistent {v[4]}/SM" if v[4] else "")
            rows[label] = checked_us_in_graph(lambda i, v=v, x=x, ws=ws: gemv_tma(x, ws[i], *v), calls, want, bound,
                                              DEV)
        for row in rows.values():
            if "us_per_call" in row:
                row["of_copy"] = nbytes / row["us_per_call"] / 1e6 * 1e12 / bw
        report["cases"].append(dict(shape=name, n=n, k=k, calls=calls, rows=rows))
        best = min(((r["us_per_call"], lb) for lb, r in rows.items() if "us_per_call" in r and "tma" in lb),
                   default=(float("nan"), "none"))
        plain, pdl = (rows[k].get("us_per_call", -1) for k in ("gemv", "gemv, PDL"))
        print(f"{name:8s} gemv {plain:.2f}, PDL {pdl:.2f} us; best TMA {best[0]:.2f} ({best[1]})", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
