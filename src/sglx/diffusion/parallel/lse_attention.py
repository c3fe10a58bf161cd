"""Attention that also returns its log-sum-exp, and the merge of partial results: what ring attention needs.

Ring attention attends each query block to one key/value block at a time and merges the partial outputs with
their log-sum-exps (the online-softmax rule). sglx's registry backends return outputs only, so the per-block
attention runs on PyTorch's own SDPA kernels that expose the LSE: flash (CUDA fp16/bf16), memory-efficient
(CUDA fp32), the CPU flash kernel, and a float32 matmul reference when none of them applies.
"""

from __future__ import annotations

import math

import torch


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k/v [B, H, S, D] -> out [B, H, Sq, D] (q's dtype), lse [B, H, Sq] float32; GQA by repeating k/v."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention: q [B, Sq, H, D], k/v [B, Skv, Hkv, D] -> (out [B, Sq, H, D], lse [B, H, Sq] fp32)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:
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
            out, lse = res[0], res[1][:, :, :qt.shape[2]]
        elif q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, False,
                                                                                   scale=scale)
    except (RuntimeError, NotImplementedError):  # shape/dtype/arch a kernel does not take: the reference runs
        out = lse = None
    if out is None or lse is None:
        out, lse = _reference(qt, kt, vt, scale)
    return out.transpose(1, 2), lse.float()


class LSEMerger:
    """Accumulates partial attention results (out_i, lse_i) of the same queries over disjoint key blocks."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # float32 [B, S, H, D]
        self.lse: torch.Tensor | None = None  # float32 [B, H, S]

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        out = out.float()
        if self.out is None or self.lse is None:
            self.out, self.lse = out, lse
            return
        new = torch.logaddexp(self.lse, lse)
        w_old = torch.exp(self.lse - new).transpose(1, 2)[..., None]  # [B, S, H, 1]
        w_new = torch.exp(lse - new).transpose(1, 2)[..., None]
        self.out = self.out * w_old + out * w_new
        self.lse = new

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.out is not None, "no partial result was added"
        return self.out.to(dtype)
