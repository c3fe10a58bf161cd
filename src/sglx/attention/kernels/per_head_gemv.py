"""y[t, h, :] = x[t, h, :] @ W[h] for a few tokens: MLA's absorbed-query and W_UV products at decode batch sizes.

Why: MLA decode multiplies each head's query by W_UK (absorb, [128 -> 512] per head) and each head's latent
output by W_UV ([512 -> 128]); torch.bmm over the heads ran those 2 MB products at 5.9 and 3.3 us a layer
in DeepSeek-V2-Lite's batch-1 CUDA-graph step on an H100 (session 14 profile), against about 0.7 us to
read the weights. Here a program owns one head and BLOCK_N output columns and multiplies the tokens (padded
to 16 rows, one tensor-core dot) by that W tile, so the weights are read once by (H x N / BLOCK_N) programs
in parallel (2.6 us a product at batch 1). Float32 accumulation, as bmm's; above MAX_TOKENS callers keep bmm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.kernels.common import dot

MAX_TOKENS = 16  # one 16-row dot; batch 32 was slower than bmm with a per-token loop (H100, V2-Lite bs32)


@triton.jit
def _per_head_gemv_kernel(X, W, Y, T, K, N, stride_xt, stride_xh, stride_wh, stride_wk, stride_wn, stride_yt, stride_yh,
                          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    h = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    w = tl.load(W + h.to(tl.int64) * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    for t0 in range(0, T, BLOCK_T):  # BLOCK_T tokens a dot (padded rows masked): one pass for T <= BLOCK_T
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        x = tl.load(X + offs_t[:, None] * stride_xt + h * stride_xh + offs_k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        y = dot(x, w, IEEE)
        tl.store(Y + offs_t[:, None] * stride_yt + h * stride_yh + offs_n[None, :], y.to(Y.dtype.element_ty),
                 mask=t_mask[:, None] & n_mask[None, :])


def per_head_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  interpret: bool = False) -> torch.Tensor:
    """x [T, H, K], w [H, K, N] (any strides) -> [T, H, N] in x's dtype (written into `out` when given)."""
    tokens, heads, k = x.shape
    if w.shape[:2] != (heads, k):
        raise ValueError(f"per-head weights {tuple(w.shape)} do not fit x {tuple(x.shape)} (want [{heads}, {k}, N])")
    n = w.shape[2]
    if out is None:
        out = torch.empty(tokens, heads, n, dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("per_head_gemv needs unit stride along x's and out's last dim")
    if tokens == 0:
        return out
    block_k = max(16, triton.next_power_of_2(k))
    # a [K, BLOCK_N] weight tile of ~8K values (64 a thread at 4 warps) stays in registers across the token blocks
    block_n = 16 if interpret else max(16, min(triton.next_power_of_2(n), 8192 // block_k))
    _per_head_gemv_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, out, tokens, k, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), BLOCK_T=16, BLOCK_K=block_k, BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
        num_warps=1 if interpret else 4)
    return out
