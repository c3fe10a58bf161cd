"""y = x @ W^T (+ b) for the few rows of a decode step: a weight-streaming Triton GEMM.

Why: at batch 1-16 a decode step's projections only stream their weights, and cuBLAS picks tiles
for such shapes that stop short of the copy bandwidth (H200 profile of Llama-3.1-8B at batch 1:
qkv and o_proj at about 75% of it, and down_proj split over K with an extra reduce kernel). Here
each program owns BLOCK_N output columns for all rows (padded to 16, the smallest tensor-core tile)
and walks the whole of K, so every weight byte is read once, with no split-K pass. Rows are few, so
the padding costs FLOPs nobody waits for.

Where it pays (same-run medians, batch 1, bf16, L2 flushed): o_proj 4096x4096 0.89x of cuBLAS's time
on an H100 and 0.94x on an H200 (cuBLAS splits K and adds a reduce kernel), the 128256x4096 LM head
0.91x / 0.98x. Not used for qkv (1.6x slower than cuBLAS on the H200), gate_up (even) or down (1.04x).
Making SiLU-and-mul while loading x for the down projection was tried and dropped: 53x slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # larger batches go to cuBLAS: their GEMMs are no longer pure weight streams


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters; `None` fields are chosen from the shape."""

    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    block_m: int | None = None  # rows per program (a power of two >= 16) = the most rows it takes; None: MAX_ROWS


@triton.jit
def _skinny_gemm_kernel(
    X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            x_mask = m_mask[:, None] & (offs_k < K)[None, :]
            w_mask = n_mask[:, None] & (offs_k < K)[None, :]
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(n: int, k: int, sms: int, config: SkinnyConfig, interpret: bool) -> tuple[int, int, int, int]:
    if interpret:
        return config.block_n or 16, config.block_k or 32, 1, 1
    # narrow column blocks until there are at least two programs per SM to keep loads in flight
    block_n = config.block_n or next((b for b in (64, 32) if triton.cdiv(n, b) >= 2 * sms), 16)
    block_k = config.block_k or (256 if k % 256 == 0 else 128)
    return block_n, block_k, config.num_warps or 4, config.num_stages or 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig = SkinnyConfig(), interpret: bool = False) -> torch.Tensor:
    """F.linear for x with at most MAX_ROWS rows (any leading shape); weight [N, K] contiguous rows."""
    *lead, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x's last dim {k} does not fit a weight of {weight.shape[1]} inputs")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    block_m = config.block_m or MAX_ROWS
    if m > block_m:
        raise ValueError(f"skinny_linear takes at most {block_m} rows, got {m}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    from sglx.attention.kernels.common import num_sms

    block_n, block_k, warps, stages = _launch(n, k, num_sms(x.device), config, interpret)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=warps, num_stages=stages,
    )
    return y.reshape(*lead, n)
