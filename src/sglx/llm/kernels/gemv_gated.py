"""silu(gate) * up of one row straight from the stacked [gate; up] weight: the gate_up GEMV and SiLU-and-mul as one
kernel.

Why: at batch 1 the SiLU-and-mul after Llama's gate_up GEMV is a launch of its own (32 a step, about 55 us of
Llama-3.1-8B's 4.4 ms on the H200, session 23 profile). Each program here owns a few gate rows and the up rows of
the same features in one tile (`row_products`), so the activation is an epilogue on values it already holds.
Roundings are the unfused path's: the products rounded to the dtype (the gate_up output), then torch's silu and
product roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.activation import silu_mul
from sglx.llm.kernels.gemv import GemvConfig, halves, launch_params, one_row, rms_args, row_products
from sglx.llm.kernels.pdl import pdl_args, pdl_prologue
from sglx.llm.kernels.rounding import round_to

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


def gemv_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: GemvConfig = GemvConfig(), interpret: bool = False, rms_eps: float | None = None
               ) -> torch.Tensor:
    """silu(x W_gate^T + b_gate) * (x W_up^T + b_up) for one row x, where weight = [W_gate; W_up] ([2I, K], rows
    contiguous) and bias = [b_gate; b_up]: what `silu_and_mul(linear(x, weight, bias))` gives, as [..., I].
    rms_eps: x is the unnormed residual stream and weight holds the norm's scale (`row_products`' RMS)."""
    *lead, k = x.shape
    rows = weight.shape[0]
    if weight.shape[1] != k or rows % 2 or weight.stride(-1) != 1:
        raise ValueError(f"gemv_gated needs a [2I, {k}] weight with contiguous rows, got {tuple(weight.shape)}")
    n_out = rows // 2
    y = torch.empty(n_out, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = launch_params(rows, k, config, interpret)
    block_p = max(1, block_n // 2)
    _gemv_gated_kernel[(triton.cdiv(n_out, block_p),)](
        one_row(x, k, "x"), weight, bias if bias is not None else weight, y, n_out, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **rms_args(k, rms_eps, config, RMS_PASS), **pdl_args(weight, interpret, config.pdl))
    return y.reshape(*lead, n_out)
