"""torch_sdpa's attention that also returns the softmax log-sum-exp (what ring attention merges partial results by).

F.scaled_dot_product_attention returns the output only, so this calls the ATen kernels behind it that expose
the LSE: flash (CUDA fp16/bf16), memory-efficient (CUDA fp32), the CPU flash kernel (any float dtype, float64
included), and a matmul reference in float32 (float64 for float64 inputs) when none of them takes the call.
It is also the documented fallback ring attention uses for a dense backend whose kernel returns no LSE.
"""

from __future__ import annotations

import math

import torch


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE (and merge) precision: float32, or float64 for float64 inputs (exact checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k/v [B, H, S, D] (same heads) -> out [B, H, Sq, D] (q's dtype), lse [B, H, Sq]."""
    acc = lse_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out.to(q.dtype), lse


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention: q [B, Sq, H, D], k/v [B, Skv, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq])."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:  # the LSE kernels take equal head counts
        rep = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    out = lse = None
    try:
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, False, False, scale=scale)
            out, lse = res[0], res[1]
        elif q.device.type == "cuda":
            res = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, False,
                                                                         scale=scale)
            out, lse = res[0], res[1][:, :, :qt.shape[2]]  # some builds pad the LSE's query axis
        elif q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, False,
                                                                                   scale=scale)[:2]
    except (RuntimeError, NotImplementedError):  # shape/dtype/arch a kernel does not take: the reference runs
        out = lse = None
    if out is None or lse is None:
        out, lse = _reference(qt, kt, vt, scale)
    return out.transpose(1, 2), lse.to(lse_dtype(q.dtype))
