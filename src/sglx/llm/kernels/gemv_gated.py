"""silu(gate) * up of one row straight from the stacked [gate; up] weight: the gate_up GEMV and SiLU-and-mul as one
kernel.

Why: at batch 1 the SiLU-and-mul after Llama's gate_up GEMV is a launch of its own (32 a step, about 55 us of
Llama-3.1-8B's 4.4 ms on the H200, session 23 profile). Each program here owns a few gate rows and the up rows of
the same features in one tile (`row_products`), so the activation is an epilogue on values it already holds.
Roundings are the unfused path's: the products rounded to the dtype (the gate_up output), then torch's silu and
product roundings.

On sm_90+ the weight tiles arrive by TMA (`_gemv_gated_tma_kernel`: each program's gate and up tiles are two boxes of
one descriptor, pipelined through shared memory by the compiler), since that measured faster at Llama-3.1-8B's
28672x4096 gate_up with the folded norm, in CUDA graphs with PDL on the H200 (session 26): 59.15-59.22 us against
61.14-61.23 for the vector-load kernel (3 stages of 8 features x 256 inputs; 16 features or 8 warps were slower). The
same route for the plain GEMV was faster only at that shape (58.14 against 60.11 us) and slower for qkv, o_proj and
down, so only this kernel has it. `SGLX_GEMV_TMA=0` keeps the vector loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sglx.attention.kernels.common import has_tma
from sglx.llm.kernels import env_switch
from sglx.llm.kernels.activation import silu_mul
from sglx.llm.kernels.gemv import GemvConfig, halves, launch_params, one_row, rms_args, row_products
from sglx.llm.kernels.pdl import pdl_args, pdl_prologue
from sglx.llm.kernels.rmsnorm import rms_rstd
from sglx.llm.kernels.rounding import round_to

_TMA_ON = env_switch("SGLX_GEMV_TMA")
# the TMA route's launch (H200 sweep above): features a program, inputs a step, pipeline stages, warps
TMA_BLOCK_P, TMA_BLOCK_K, TMA_STAGES, TMA_WARPS = 8, 256, 3, 4

# The folded norm's sum of squares in the loop: 61.53 us against 63.30 with a pass over x before it and 63.96 for the
# norm kernel then this GEMV (H200, Llama-3.1-8B gate_up in graphs, session 25): its grid runs several waves anyway,
# so the loop's extra registers (80 -> 89) cost less than the pass's latency at every program's start.
RMS_PASS = 1


@triton.jit
def _gemv_gated_kernel(X, W, B, Y, n_out, K, stride_wn, eps, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_K: tl.constexpr, RMS: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    dt = Y.dtype.element_ty
    lane = tl.arange(0, 2 * BLOCK_P)  # BLOCK_P gate rows, then the up rows of the same features
    feature = tl.program_id(0) * BLOCK_P + lane % BLOCK_P
    row = feature + (lane // BLOCK_P) * n_out
    mask = feature < n_out
    y = row_products(X, W + row[:, None].to(tl.int64) * stride_wn, mask, K, eps, BLOCK_K, RMS, KP)
    if HAS_BIAS:
        y += tl.load(B + row, mask=mask, other=0.0).to(tl.float32)
    g, up = halves(y, BLOCK_P)
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    tl.store(Y + offs, silu_mul(round_to(g, dt), round_to(up, dt), dt).to(dt), mask=offs < n_out)


@triton.jit
def _gemv_gated_tma_kernel(X, W_desc, B, Y, n_out, K, eps, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_K: tl.constexpr, RMS: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """`_gemv_gated_kernel` with the weight's gate rows [f0, f0 + BLOCK_P) and up rows [n_out + f0, ...) as two TMA
    boxes a step (past the weight's last row or column the boxes read zeros; a last gate box that runs into the up
    rows only feeds features past n_out, which are not stored). RMS: the folded norm, sum of squares in the loop."""
    pdl_prologue(PDL)
    dt = Y.dtype.element_ty
    f0 = tl.program_id(0) * BLOCK_P
    acc_g = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        g = W_desc.load([f0, k0])
        u = W_desc.load([n_out + f0, k0])
        x = tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        if RMS:
            ss += x * x
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
    yg = tl.sum(acc_g, axis=1)
    yu = tl.sum(acc_u, axis=1)
    if RMS:
        rstd = rms_rstd(tl.sum(ss, axis=0), K, eps)
        yg = yg * rstd
        yu = yu * rstd
    offs = f0 + tl.arange(0, BLOCK_P)
    mask = offs < n_out
    if HAS_BIAS:
        yg += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        yu += tl.load(B + n_out + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, silu_mul(round_to(yg, dt), round_to(yu, dt), dt).to(dt), mask=mask)


def tma_route(weight: torch.Tensor, config: GemvConfig, interpret: bool) -> bool:
    """Whether gemv_gated takes the TMA kernel: switched on (config.tma, else SGLX_GEMV_TMA), the folded norm (if
    any) summed in the loop, a device with TMA (or the interpreter), and a weight a descriptor can address (base and
    row stride 16-byte aligned)."""
    on = _TMA_ON if config.tma is None else config.tma
    return (on and config.rms_pass in (None, 1) and (interpret or has_tma(weight.device))
            and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0)


def _gated_tma(x1: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               config: GemvConfig, interpret: bool, rms_eps: float | None) -> None:
    rows, k = weight.shape
    n_out = rows // 2
    if interpret:
        block_p, block_k, stages, warps = max(1, (config.block_n or 4) // 2), config.block_k or 32, 1, 1
    else:
        block_p = max(1, config.block_n // 2) if config.block_n else TMA_BLOCK_P
        block_k, stages = config.block_k or TMA_BLOCK_K, config.num_stages or TMA_STAGES
        warps = config.num_warps or TMA_WARPS
    desc = TensorDescriptor(weight, [rows, k], [weight.stride(0), 1], [block_p, block_k])
    _gemv_gated_tma_kernel[(triton.cdiv(n_out, block_p),)](
        x1, desc, bias if bias is not None else weight, y, n_out, k, float(rms_eps or 0.0),
        HAS_BIAS=bias is not None, BLOCK_P=block_p, BLOCK_K=block_k, RMS=rms_eps is not None, STAGES=stages,
        num_warps=warps, num_stages=stages, **pdl_args(weight, interpret, config.pdl))


def gemv_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: GemvConfig = GemvConfig(), interpret: bool = False, rms_eps: float | None = None
               ) -> torch.Tensor:
    """silu(x W_gate^T + b_gate) * (x W_up^T + b_up) for one row x, where weight = [W_gate; W_up] ([2I, K], rows
    contiguous) and bias = [b_gate; b_up]: what `silu_and_mul(linear(x, weight, bias))` gives, as [..., I].
    rms_eps: x is the unnormed residual stream and weight holds the norm's scale (`row_products`' RMS). On sm_90+ the
    weight tiles come by TMA (`tma_route`)."""
    *lead, k = x.shape
    rows = weight.shape[0]
    if weight.shape[1] != k or rows % 2 or weight.stride(-1) != 1:
        raise ValueError(f"gemv_gated needs a [2I, {k}] weight with contiguous rows, got {tuple(weight.shape)}")
    n_out = rows // 2
    y = torch.empty(n_out, dtype=x.dtype, device=x.device)
    if tma_route(weight, config, interpret):
        _gated_tma(one_row(x, k, "x"), weight, bias, y, config, interpret, rms_eps)
        return y.reshape(*lead, n_out)
    block_n, block_k, warps, stages = launch_params(rows, k, config, interpret)
    block_p = max(1, block_n // 2)
    _gemv_gated_kernel[(triton.cdiv(n_out, block_p),)](
        one_row(x, k, "x"), weight, bias if bias is not None else weight, y, n_out, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **rms_args(k, rms_eps, config, RMS_PASS), **pdl_args(weight, interpret, config.pdl))
    return y.reshape(*lead, n_out)
