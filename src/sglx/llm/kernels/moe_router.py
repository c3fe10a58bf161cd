"""DeepSeek's greedy MoE router in one launch: float32 logits, softmax, top-k and the weight scaling.

Why: at batch 1 the torch router is five launches per MoE layer (the hidden row and the gate weight cast to
float32, a float32 cuBLAS dot, softmax, `torch.topk`) for a [1, E] result; in DeepSeek-V2-Lite's CUDA-graph
decode step (H100, session 13) that was 130 of about 540 launches and about 0.35 ms of 4.2. Here one program
per token computes the E logits in float32 (bf16/fp16 products are exact in float32, so they equal the
reference's float32 GEMM up to summation order), their softmax, and the top k by K rounds of (max, lowest
index holding it), then writes weights (renormalised or scaled, as `select_experts`) and ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 256  # each program reads the whole gate weight (E x H) from L2: fine for decode-sized steps


@triton.jit
def _greedy_router_kernel(X, W, Weights, Ids, E, H, stride_x, stride_w, scale,
                          K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        x = tl.load(X + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs_e[:, None] * stride_w + offs_h[None, :], mask=e_mask[:, None] & h_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    logits = tl.where(e_mask, acc, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 0))
    scores = p / tl.sum(p, 0)
    left = tl.where(e_mask, scores, -1.0)  # softmax scores are >= 0: -1 marks padding and chosen experts
    rank = tl.full([BLOCK_E], -1, dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, offs_e, BLOCK_E), 0)
        rank = tl.where(offs_e == pick, i, rank)
        left = tl.where(offs_e == pick, -1.0, left)
    chosen = rank >= 0
    weights = scores / (tl.sum(tl.where(chosen, scores, 0.0), 0) + 1e-20) if RENORM else scores * scale
    tl.store(Weights + t * K + rank, weights, mask=chosen)
    tl.store(Ids + t * K + rank, offs_e.to(tl.int64), mask=chosen)


def greedy_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                  interpret: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [E, H] -> (weights [T, k] float32, expert ids [T, k] int64): softmax over
    x @ gate_weight^T in float32, the k best experts, their scores renormalised to sum 1 (`renormalize`) or
    times `scale`."""
    tokens, hidden = x.shape
    experts = gate_weight.shape[0]
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in 1..{experts} (the number of experts)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    if tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(experts)
    block_h = 16 if interpret else max(16, min(256, 8192 // block_e))
    _greedy_router_kernel[(tokens,)](
        x, gate_weight, weights, ids, experts, hidden, x.stride(0), gate_weight.stride(0), float(scale),
        K=top_k, RENORM=renormalize, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=1 if interpret else 4)
    return weights, ids
