"""y = x @ W^T for the few rows of a batched decode step (up to 64), split over K where that fills the GPU, with the
step's small kernels as epilogues.

Why: at batch 64 a Llama-3.1-8B decode step still streams its weights (the rows are 0.5 MB against 16 GB), but cuBLAS
runs them at 77-91% of the copy bandwidth and the step adds an add + norm, SiLU-and-mul, rotary and a split-K reduce
kernel around them (H100 profile, session 13: 0.45 ms of an 8.2 ms step). With one tile of output columns a program,
every program also reads all of x from L2: at 64 rows that is 132 x 0.5 MB a product, as much as o_proj's weights,
so narrow products split K (each program then reads its part of x) and the last split of a column tile to finish
sums the float32 partials (a ticket, as the split-KV decode merge does: no second kernel) and runs the epilogue.

Epilogues (EPI): 0 none; 1 adds a residual row block (y = r + x W^T, rounded as the product and then torch's add:
o_proj and down adding to the residual stream); 2 gated (W = [W_gate; W_up], each program gathers gate and up rows
of the same features into one tile: y = silu(gate) * up). RMS: the rows are an unnormed residual stream and W holds
the norm's scale (sglx.llm.layers.norm_folding): the loop also sums x's squares and the finished sums are scaled by
1 / rms of their row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.activation import silu_mul
from sglx.llm.kernels.rmsnorm import rms_rstd
from sglx.llm.kernels.rounding import round_to

MAX_ROWS = 64


@dataclass(frozen=True)
class RowsGemmConfig:
    """Launch parameters; `None` fields are chosen from the shape (`launch_params`)."""

    block_n: int | None = None
    block_k: int | None = None
    splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@triton.jit
def _gathered_halves(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_M, 2 * HALF] -> the first HALF columns and the second HALF (gate and up of the same features)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def _rows_gemm_kernel(X, W, Y, R, Part, Part_ss, Tickets, M, N, K, n_out, stride_pm, stride_xm, stride_wn,
                      stride_ym, stride_rm, k_per_split, eps, EPI: tl.constexpr, RMS: tl.constexpr,
                      SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    dt = Y.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    lane = tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = BLOCK_N // 2
    if EPI == 2:  # BLOCK_N / 2 gate rows, then the up rows of the same features
        feature = pid_n * HALF + lane % HALF
        rows = feature + (lane // HALF) * n_out
        n_mask = feature < n_out
    else:
        rows = pid_n * BLOCK_N + lane
        n_mask = rows < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    x_ptrs = X + offs_m[:, None] * stride_xm
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_ptrs + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if RMS:
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLITS > 1:  # partials to scratch; the last split of this column tile to arrive sums them
        part = Part + offs_m[:, None] * stride_pm + (pid_n * BLOCK_N + lane)[None, :]
        tl.store(part + split * M * stride_pm, acc, mask=m_mask[:, None])
        if RMS:
            tl.store(Part_ss + (split * tl.num_programs(0) + pid_n) * BLOCK_M + offs_m, ss)
        tl.debug_barrier()
        ticket = tl.atomic_add(Tickets + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(SPLITS):
                acc += tl.load(part + s * M * stride_pm, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
                if RMS:
                    ss += tl.load(Part_ss + (s * tl.num_programs(0) + pid_n) * BLOCK_M + offs_m, cache_modifier=".cg")
            tl.atomic_xchg(Tickets + pid_n, 0)  # ready for the next launch (CUDA graph replays included)
            _epilogue(acc, ss, Y, R, pid_n, offs_m, m_mask, lane, N, n_out, K, eps, stride_ym, stride_rm, dt,
                      EPI, RMS, BLOCK_M, BLOCK_N)
    else:
        _epilogue(acc, ss, Y, R, pid_n, offs_m, m_mask, lane, N, n_out, K, eps, stride_ym, stride_rm, dt,
                  EPI, RMS, BLOCK_M, BLOCK_N)


@triton.jit
def _epilogue(acc, ss, Y, R, pid_n, offs_m, m_mask, lane, N, n_out, K, eps, stride_ym, stride_rm, dt: tl.constexpr,
              EPI: tl.constexpr, RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if RMS:
        acc = acc * rms_rstd(ss, K, eps)[:, None]
    if EPI == 2:
        HALF: tl.constexpr = BLOCK_N // 2
        g, up = _gathered_halves(acc, BLOCK_M, HALF)
        cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(Y + offs_m[:, None] * stride_ym + cols[None, :], silu_mul(round_to(g, dt), round_to(up, dt), dt)
                 .to(dt), mask=m_mask[:, None] & (cols < n_out)[None, :])
    else:
        cols = pid_n * BLOCK_N + lane
        mask = m_mask[:, None] & (cols < N)[None, :]
        y = round_to(acc, dt)
        if EPI == 1:
            y = round_to(y + tl.load(R + offs_m[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
                         .to(tl.float32), dt)
        tl.store(Y + offs_m[:, None] * stride_ym + cols[None, :], y.to(dt), mask=mask)


def launch_params(m: int, n: int, k: int, sms: int, config: RowsGemmConfig = RowsGemmConfig(),
                  interpret: bool = False) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, splits, num_warps, num_stages). Not yet measured: 64-column tiles, and K split so that
    column tiles x splits reach about one program an SM (an SM then reads only its part of x)."""
    if interpret:
        return config.block_n or 16, config.block_k or 32, config.splits or 1, 1, 1
    block_n = config.block_n or 64
    block_k = config.block_k or 128
    tiles = triton.cdiv(n, block_n)
    splits = config.splits or max(1, min(sms // tiles, triton.cdiv(k, 4 * block_k)))
    return block_n, block_k, splits, config.num_warps or 4, config.num_stages or 4


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, add_to: torch.Tensor | None = None, gated: bool = False,
              rms_eps: float | None = None, out: torch.Tensor | None = None, config: RowsGemmConfig = RowsGemmConfig(),
              interpret: bool = False) -> torch.Tensor:
    """x @ weight^T for x [m, K] (m <= MAX_ROWS), weight [N, K] with contiguous rows; `add_to` [m, N]: add_to + that
    (`out` may be add_to itself: the stream updated in place); `gated`: weight = [W_gate; W_up] and the result is
    silu(x W_gate^T) * (x W_up^T) [m, N / 2]; `rms_eps`: x is unnormed and weight holds the norm's scale."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError("rows_gemm needs a 2-D x and weight with contiguous rows")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x's last dim {k} does not fit a weight of {weight.shape[1]} inputs")
    if m > MAX_ROWS:
        raise ValueError(f"rows_gemm takes at most {MAX_ROWS} rows, got {m}")
    if gated and (n % 2 or add_to is not None):
        raise ValueError("rows_gemm gated needs an even [2I, K] weight and no add_to")
    n_out = n // 2 if gated else n
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if add_to is not None and (add_to.shape != (m, n) or add_to.stride(-1) != 1):
        raise ValueError(f"add_to must be [{m}, {n}] with contiguous rows, got {tuple(add_to.shape)}")
    if m == 0:
        return out
    from sglx.attention.kernels.common import num_sms

    block_n, block_k, splits, warps, stages = launch_params(m, n, k, num_sms(x.device), config, interpret)
    tiles = triton.cdiv(n_out, block_n // 2) if gated else triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    block_m = _block_m(m)
    if splits > 1:
        part = torch.empty(splits, m, tiles * block_n, dtype=torch.float32, device=x.device)
        part_ss = torch.empty(splits, tiles, block_m, dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, tiles)
    else:
        part = part_ss = tickets = out
    r = add_to if add_to is not None else out
    _rows_gemm_kernel[(tiles, splits)](
        x, weight, out, r, part, part_ss, tickets, m, n, k, n_out, tiles * block_n, x.stride(0), weight.stride(0),
        out.stride(0), r.stride(0), k_per_split,
        float(rms_eps) if rms_eps is not None else 0.0, EPI=2 if gated else int(add_to is not None),
        RMS=rms_eps is not None, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per column tile, shared by every launch on the device: each launch leaves them
    at zero again (the last split resets its tile's), and launches on one stream never overlap."""
    have = _TICKETS.get(device)
    if have is None or have.numel() < count:
        have = _TICKETS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return have
