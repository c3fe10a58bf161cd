"""One row's product, added to the residual stream and RMS-normed for the next layer, in one kernel.

Why: at batch 1 every residual add + RMSNorm of Llama is a launch of its own (65 a step, about 185 us of
Llama-3.1-8B's 4.4 ms on the H200, session 23 profile), and taking the norm into the *next* GEMV's loop at 4,096
inputs measured slower than the two kernels. Here the product before the norm (o_proj, down) writes r + W x for its
features; the program that finishes last (an acq_rel ticket, as the split-KV merge in decode attention does) then
norms the whole row, which only it can see complete. The row is a few KB, so that tail is short beside a launch.
Roundings are the unfused path's: the product rounded to the dtype, torch's add, then Hugging Face's norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.gemv import GemvConfig, launch_params, one_row, pair_products
from sglx.llm.kernels.rmsnorm import rms_rstd, rms_weighted
from sglx.llm.kernels.rounding import round_to

# the last program holds the whole row in registers
MAX_FEATURES = 16384

_tickets: dict[torch.device, torch.Tensor] = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """The device's ticket counter: kernels on one stream run one after another and each leaves it at 0, so one
    serves every call (the first call must be eager, before any CUDA graph captures it)."""
    t = _tickets.get(device)
    if t is None:
        t = _tickets[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


@triton.jit
def _stream_update(y, B, R, R_Out, offs, mask, HAS_BIAS: tl.constexpr, DT: tl.constexpr):
    """r + round(y (+ b)) for some features, rounded as torch's add, stored as the new residual."""
    if HAS_BIAS:
        y += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    h = round_to(tl.load(R + offs, mask=mask, other=0.0).to(tl.float32) + round_to(y, DT), DT)
    tl.store(R_Out + offs, h.to(DT), mask=mask)


@triton.jit
def _gemv_add_norm_kernel(X, W, B, R, G, R_Out, Out, Ticket, N, K, stride_wn, eps, HAS_BIAS: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr):
    dt = Out.dtype.element_ty
    offs_a = tl.program_id(0) * 2 * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_b = offs_a + BLOCK_P
    mask_a = offs_a < N
    mask_b = offs_b < N
    rows_a = W + offs_a[:, None].to(tl.int64) * stride_wn
    y_a, y_b = pair_products(X, rows_a, rows_a + BLOCK_P * stride_wn, mask_a, mask_b, K, BLOCK_K)
    _stream_update(y_a, B, R, R_Out, offs_a, mask_a, HAS_BIAS, dt)
    _stream_update(y_b, B, R, R_Out, offs_b, mask_b, HAS_BIAS, dt)
    tl.debug_barrier()  # every thread's residual stores come before the (single-thread) release of the ticket
    ticket = tl.atomic_add(Ticket, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_ROW)
        mask = offs < N
        h = tl.load(R_Out + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)  # past L1: other SMs
        rstd = rms_rstd(tl.sum(h * h, axis=0), N, eps)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + offs, rms_weighted(h, rstd, g, dt).to(dt), mask=mask)
        tl.atomic_xchg(Ticket, 0)


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, config: GemvConfig = GemvConfig(),
                  interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h), h) for h = residual + (x @ weight^T + bias) and one row x: what `linear` then
    `RMSNorm.add_and_norm` give, in one launch. weight [N, K] with contiguous rows, residual and norm_weight [N]."""
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"gemv_add_norm needs a [N, {k}] weight with contiguous rows, got {tuple(weight.shape)}")
    if n > MAX_FEATURES or norm_weight.numel() != n:
        raise ValueError(f"gemv_add_norm norms rows of at most {MAX_FEATURES} features with a weight of each: "
                         f"got {n} features and a norm weight of {norm_weight.numel()}")
    r1 = one_row(residual, n, "residual")
    new_residual = torch.empty_like(r1)
    out = torch.empty_like(r1)
    block_n, block_k, warps, stages = launch_params(n, k, config, interpret)
    block_p = max(1, block_n // 2)
    _gemv_add_norm_kernel[(triton.cdiv(n, 2 * block_p),)](
        one_row(x, k, "x"), weight, bias if bias is not None else weight, r1, norm_weight, new_residual, out,
        _ticket(x.device), n, k, weight.stride(0), float(eps), HAS_BIAS=bias is not None, BLOCK_P=block_p,
        BLOCK_K=block_k, BLOCK_ROW=triton.next_power_of_2(n), num_warps=warps, num_stages=stages)
    return out.reshape(*lead, n), new_residual.reshape(*lead, n)
