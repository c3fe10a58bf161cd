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

from sglx.llm.kernels.gemv import GemvConfig, launch_params, one_row, row_products
from sglx.llm.kernels.rmsnorm import rms_rstd, rms_weighted
from sglx.llm.kernels.rounding import round_to

# the last program holds the whole row in registers
MAX_FEATURES = 16384
# Programs draw tickets in groups of GROUP, and each group's last program one ticket from the top counter: 1,024
# programs drawing from one address all at once (they all finish together) queue up at that address.
GROUP = 32
_SPACING = 32  # int32 counters 128 bytes apart: each in its own cache line
_MAX_GROUPS = 512

_tickets: dict[torch.device, torch.Tensor] = {}


def _tickets_for(device: torch.device) -> torch.Tensor:
    """The device's ticket counters (the top one, then one a group): kernels on one stream run one after another and
    each leaves them at 0, so one set serves every call (the first call must be eager, before any CUDA graph
    captures it)."""
    t = _tickets.get(device)
    if t is None:
        t = _tickets[device] = torch.zeros((1 + _MAX_GROUPS) * _SPACING, dtype=torch.int32, device=device)
    return t


@triton.jit
def _last_to_finish(Tickets, GROUP: tl.constexpr, SPACING: tl.constexpr):
    """Whether this program is the last of the grid to get here, by a group ticket then (for a group's last program)
    the top ticket; acq_rel at GPU scope, so the last one sees every program's stores made before its ticket. Each
    counter is reset by whoever drew its last ticket."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    group = pid // GROUP
    groups = tl.cdiv(n, GROUP)
    counter = Tickets + (1 + group) * SPACING
    last = False
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.minimum(GROUP, n - group * GROUP) - 1:
        tl.atomic_xchg(counter, 0)
        if tl.atomic_add(Tickets, 1, sem="acq_rel", scope="gpu") == groups - 1:
            tl.atomic_xchg(Tickets, 0)
            last = True
    return last


@triton.jit
def _gemv_add_norm_kernel(X, W, B, R, G, R_Out, Out, Tickets, N, K, stride_wn, eps, HAS_BIAS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr,
                          GROUP: tl.constexpr, SPACING: tl.constexpr):
    dt = Out.dtype.element_ty
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    y = row_products(X, W + offs[:, None].to(tl.int64) * stride_wn, mask, K, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    h = round_to(tl.load(R + offs, mask=mask, other=0.0).to(tl.float32) + round_to(y, dt), dt)  # torch's add
    tl.store(R_Out + offs, h.to(dt), mask=mask)
    tl.debug_barrier()  # every thread's residual stores come before the (single-thread) release of the ticket
    if _last_to_finish(Tickets, GROUP, SPACING):
        row = tl.arange(0, BLOCK_ROW)
        row_mask = row < N
        stream = tl.load(R_Out + row, mask=row_mask, other=0.0, cache_modifier=".cg").to(tl.float32)  # past L1
        rstd = rms_rstd(tl.sum(stream * stream, axis=0), N, eps)
        g = tl.load(G + row, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(Out + row, rms_weighted(stream, rstd, g, dt).to(dt), mask=row_mask)


def gemv_add_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, config: GemvConfig = GemvConfig(),
                  interpret: bool = False, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h), h) for h = residual + (x @ weight^T + bias) and one row x: what `linear` then
    `RMSNorm.add_and_norm` give, in one launch. weight [N, K] with contiguous rows, residual and norm_weight [N];
    `group`: programs a group ticket counter (default GROUP; the grid's size: one counter, for measuring)."""
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
    programs = triton.cdiv(n, block_n)
    group = group or GROUP
    if triton.cdiv(programs, group) > _MAX_GROUPS:
        raise ValueError(f"gemv_add_norm: {programs} programs in groups of {group} need more than {_MAX_GROUPS} "
                         "ticket counters")
    _gemv_add_norm_kernel[(programs,)](
        one_row(x, k, "x"), weight, bias if bias is not None else weight, r1, norm_weight, new_residual, out,
        _tickets_for(x.device), n, k, weight.stride(0), float(eps), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_ROW=triton.next_power_of_2(n), GROUP=group, SPACING=_SPACING, num_warps=warps,
        num_stages=stages)
    return out.reshape(*lead, n), new_residual.reshape(*lead, n)
