"""RMSNorm and residual-add + RMSNorm in one kernel each, with Hugging Face's arithmetic.

HF: y = weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype). The kernel computes the
same in float32 and rounds where HF rounds (to the input dtype, then the product with the weight),
so the only difference left is the order of the float32 sum. The fused variant first forms
residual + x in the input dtype (one rounding, as torch's add) and writes it out as the new residual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.rounding import round_to

MAX_BLOCK = 65536  # one program holds a whole row; wider rows are not a real hidden size


@triton.jit
def rms_rstd(sum_sq, n_cols, eps):
    """1 / sqrt(sum_sq / n_cols + eps) with IEEE sqrt and division: closest to torch.rsqrt."""
    return tl.div_rn(1.0, tl.sqrt_rn(sum_sq / n_cols + eps))


@triton.jit
def rms_weighted(x, rstd, w, DT: tl.constexpr):
    """HF's roundings of the normed row: x * rstd to DT, then the weight times that to DT (float32 values)."""
    return round_to(w * round_to(x * rstd, DT), DT)


@triton.jit
def _rmsnorm_kernel(X, Residual, Weight, Out, Residual_Out, n_rows, n_cols, eps,
                    stride_x, stride_r, stride_o, stride_ro,
                    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    dt = X.dtype.element_ty
    xf = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xf = round_to(r + xf, dt)  # torch's add: one rounding
        tl.store(Residual_Out + rows64[:, None] * stride_ro + cols[None, :], xf.to(dt), mask=mask)
    rstd = rms_rstd(tl.sum(xf * xf, axis=1), n_cols, eps)
    w = tl.load(Weight + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = rms_weighted(xf, rstd[:, None], w[None, :], dt)
    tl.store(Out + rows64[:, None] * stride_o + cols[None, :], y.to(dt), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, hidden] tensor with unit column stride (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2: torch.Tensor, residual2: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
    n_rows, n_cols = x2.shape
    if n_rows == 0:
        return
    block_n = triton.next_power_of_2(n_cols)
    if block_n > MAX_BLOCK:
        raise ValueError(f"RMSNorm over {n_cols} columns is wider than the kernel's {MAX_BLOCK}")
    rows = max(1, min(16, 2048 // block_n))  # narrow rows (per-head q/k norms): several rows per program
    warps = max(1, min(8, rows * block_n // 512))
    has_res = residual2 is not None
    _rmsnorm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, residual2 if has_res else x2, weight, out, residual_out if has_res else out, n_rows, n_cols, float(eps),
        x2.stride(0), residual2.stride(0) if has_res else 0, out.stride(0),
        residual_out.stride(0) if has_res else 0,
        HAS_RESIDUAL=has_res, ROWS=rows, BLOCK_N=block_n, num_warps=warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape) -> a new tensor of x's shape and dtype."""
    x2 = _as_rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, None, weight, eps, out, None)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) from one kernel; x and residual are left unchanged."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x2, r2 = _as_rows(x), _as_rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, r2, weight, eps, out, new_residual)
    return out.view(x.shape), new_residual.view(x.shape)
