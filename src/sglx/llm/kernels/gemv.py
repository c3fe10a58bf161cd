"""y = x @ W^T (+ b) for one row: a weight-streaming GEMV on the CUDA cores, no tensor-core padding.

Why: a batch-1 decode step only streams its projections' weights, and a 33-50 MB projection has to stream at
the copy bandwidth to reach the step's floor. cuBLAS reaches about 74% of it on the H200 for Llama-3.1-8B's qkv
and the skinny `tl.dot` GEMM (sglx.llm.kernels.skinny_gemm: one row padded to 16) about the same for o_proj and
the LM head (session 23 profile). Here each program owns BLOCK_N output features and walks the whole of K with
wide loads, multiplying in float32 on the CUDA cores (one row needs 2 FLOPs a weight: no tensor core to feed),
and sums its [BLOCK_N, BLOCK_K] partial products once, after the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.pdl import pdl_args, pdl_prologue
from sglx.llm.kernels.rmsnorm import rms_rstd
from sglx.llm.kernels.rounding import round_to


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters; `None` fields are chosen from the shape."""

    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    pdl: bool | None = None  # programmatic dependent launch (sglx.llm.kernels.pdl); None: SGLX_GEMV_PDL
    rms_pass: int | None = None  # folded norm: sum of squares in the loop (1) or a pass before it (2); None: per kernel
    tma: bool | None = None  # weight tiles by TMA where the kernel has that route (gemv_gated); None: SGLX_GEMV_TMA


@triton.jit
def _gemv_kernel(X, R, G, R_Out, W, B, Y, N, K, stride_wn, eps, NORM: tl.constexpr, ADD: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """NORM 0: y = W x; 1: y = W rmsnorm(x); 2: y = W rmsnorm(r + x), program 0 writing r + x (rounded as torch's
    add) to R_Out. The norm's sum of squares is gathered in the same pass over x as the products of x * g, and
    1 / rms scales the finished sums: the normed row is never rounded to the input dtype (Hugging Face rounds
    x * rstd and then g times that), so outputs differ from norm-then-GEMM by those roundings, not by more.
    ADD (with NORM 0): y = r + W x, rounded as the product's output and then torch's add."""
    pid = tl.program_id(0)
    dt = Y.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    pdl_prologue(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(X + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM == 2:
            x = round_to(tl.load(R + offs_k, mask=k_mask, other=0.0).to(tl.float32) + x, dt)
            if pid == 0:
                tl.store(R_Out + offs_k, x.to(dt), mask=k_mask)
        if NORM > 0:
            ss += x * x
            x = x * tl.load(G + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if NORM > 0:
        y = y * rms_rstd(tl.sum(ss, axis=0), K, eps)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if ADD:
        y = round_to(y, dt) + tl.load(R + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, round_to(y, dt).to(dt), mask=n_mask)  # round_to: the interpreter truncates casts


@triton.jit
def row_products(X, rows, mask, K, eps, BLOCK_K: tl.constexpr, RMS: tl.constexpr, KP: tl.constexpr):
    """W x in float32 for the weight rows `rows` (a pointer column [R, 1], any rows, masked by `mask`): the plain
    GEMV's loop, for the fused GEMVs (sglx.llm.kernels.gemv_*), which gather the rows their epilogue combines (gate
    with up, the two halves of a rotary pair) into one tile: one tile a step measured faster than two half tiles.
    RMS: W rmsnorm(x) for a W that holds the norm's scale (folded at load: sglx.llm.layers.norm_folding), i.e. W x
    times 1 / rms(x); 1 gathers the sum of squares in the loop, 2 in a pass over x (KP = next power of 2 of K)
    before it."""
    acc = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if RMS == 2:
        offs_all = tl.arange(0, KP)
        x_all = tl.load(X + offs_all, mask=offs_all < K, other=0.0).to(tl.float32)
        rstd = rms_rstd(tl.sum(x_all * x_all, axis=0), K, eps)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(rows + offs_k[None, :], mask=mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(X + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if RMS == 1:
            ss += x * x
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if RMS == 1:
        y = y * rms_rstd(tl.sum(ss, axis=0), K, eps)
    if RMS == 2:
        y = y * rstd
    return y


@triton.jit
def halves(y, HALF: tl.constexpr):
    """[2 * HALF] -> (first half, second half): the two row groups a fused GEMV gathered into one tile."""
    return tl.split(tl.permute(tl.reshape(y, (2, HALF)), (1, 0)))


SHORT_ROWS = 2048  # inputs up to which the plain GEMV takes its short-row launches (`launch_params`)


def launch_params(n: int, k: int, config: GemvConfig = GemvConfig(), interpret: bool = False,
                  short_rows: str | None = None) -> tuple[int, int, int, int]:
    """Measured on the H200 in graphs (bench_gemv.py --sweep, session 23): 8 features x 512 inputs a step and 4
    warps for wide outputs; at most 4,096 features, 4 x 1,024 (4 x 512 past 4,096 inputs) and 8 warps, so the grid
    still has about 8 programs an SM. short_rows ("plain" or "normed", the plain GEMV `gemv` only: the fused ones
    were not swept so) with at most SHORT_ROWS inputs on at most 4,096 features: 4 warps, and 4 x 2,048 (the whole
    row in one step) plain, 8 x 1,024 with the norm inside (session 31 sweep, benchmarks/results/s31/call6,
    DeepSeek-V2-Lite: q + kv_a 5.49 against 6.29 us plain and 6.15 against 7.43 with add + norm inside, o_proj 3.73
    against 4.08)."""
    if interpret:
        return config.block_n or 4, config.block_k or 32, 1, 1
    narrow = n <= 4096
    if short_rows is not None and narrow and k <= SHORT_ROWS:
        block_n, block_k = (4, 2048) if short_rows == "plain" else (8, 1024)
        return config.block_n or block_n, config.block_k or block_k, config.num_warps or 4, config.num_stages or 3
    block_n = config.block_n or (4 if narrow else 8)
    block_k = config.block_k or (1024 if narrow and k <= 4096 else 512)
    return block_n, block_k, config.num_warps or (8 if narrow else 4), config.num_stages or 3


@dataclass(frozen=True)
class NormInput:
    """The GEMV's input is rmsnorm(residual + x) (or rmsnorm(x) without a residual), normed inside the kernel."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None


def rms_args(k: int, rms_eps: float | None, config: GemvConfig, rms_pass: int) -> dict:
    """The fused GEMVs' folded-norm arguments (`row_products`' eps, RMS and KP) for rms_eps None (no norm) or the
    norm's eps; `rms_pass` is the kernel's default where the config leaves it open."""
    if rms_eps is None:
        return {"eps": 0.0, "RMS": 0, "KP": 1}
    return {"eps": float(rms_eps), "RMS": config.rms_pass or rms_pass, "KP": triton.next_power_of_2(k)}


def one_row(t: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if t.numel() != k:
        raise ValueError(f"gemv takes one row of {k}, got {what} of shape {tuple(t.shape)}")
    t1 = t.reshape(k)
    return t1 if t1.stride(0) == 1 else t1.contiguous()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, norm: NormInput | None = None,
         config: GemvConfig = GemvConfig(), interpret: bool = False, add_to: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x' @ weight^T + bias, residual + x or None) for one row x (any leading shape of one row), where x' is x or
    `norm`'s rmsnorm of it; weight [N, K] with contiguous rows. The second value is the updated residual stream
    when `norm` has a residual (written by the kernel), else None. `add_to` (one row of N, without `norm`): the
    first value is add_to + x @ weight^T + bias, the residual add after a layer's last product in its epilogue."""
    *lead, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x's last dim {k} does not fit a weight of {weight.shape[1]} inputs")
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous")
    x1 = one_row(x, k, "x")
    n = weight.shape[0]
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    mode, r1, g, r_out, eps = 0, x1, x1, x1, 0.0
    new_residual = None
    if add_to is not None:
        if norm is not None:
            raise ValueError("gemv adds to a row after a plain product only (add_to with norm)")
        r1 = one_row(add_to, n, "add_to")
    if norm is not None:
        mode, g, eps = 1, norm.weight, float(norm.eps)
        if norm.residual is not None:
            mode, r1 = 2, one_row(norm.residual, k, "residual")
            new_residual = torch.empty_like(x1)
            r_out = new_residual
    block_n, block_k, warps, stages = launch_params(n, k, config, interpret, "normed" if mode else "plain")
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x1, r1, g, r_out, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), eps,
        NORM=mode, ADD=add_to is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl_args(weight, interpret, config.pdl),
    )
    return y.reshape(*lead, n), (new_residual.view(x.shape) if new_residual is not None else None)
