"""DeepSeek's greedy MoE router in one launch: float32 logits, softmax, top-k and the weight scaling.

Why: at batch 1 the torch router is five launches per MoE layer (the hidden row and the gate weight cast to
float32, a float32 cuBLAS dot, softmax, `torch.topk`) for a [1, E] result; in DeepSeek-V2-Lite's CUDA-graph
decode step (H100, session 13) that was 130 of about 540 launches and about 0.35 ms of 4.2. Here programs
(token, block of experts) compute their logits in float32 over the whole hidden row (bf16/fp16 products are
exact in float32, so they equal the reference's float32 GEMM up to summation order) in parallel, so the gate
weight streams through many SMs (a first version with one program a token read it through one SM and made
the V2-Lite step 0.22 ms slower). The program that finishes a token last (an acq_rel ticket, as the decode
kernel's in-kernel split merge) takes the softmax and the top k by K rounds of (max, lowest index holding
it), writes weights (renormalised or scaled, as `select_experts`) and ids, and resets the token's ticket.

With `add_norm`, the router also takes the decoder layer's post-attention residual add and RMSNorm (the
`rmsnorm` kernel's arithmetic and rounding): every program forms the normed row it needs from the attention
output and the residual, and the token's first program writes the normed row and the new residual for the
experts. That is one launch less a MoE layer (V2-Lite at batch 1: 26 of about 300 a step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.rmsnorm import rms_rstd, rms_weighted
from sglx.llm.kernels.rounding import round_to

MAX_TOKENS = 256  # every expert block re-reads the token's row: meant for decode-sized steps


@triton.jit
def _added_row(X, Residual, t, offs_h, h_mask, stride_x, stride_r, DT: tl.constexpr):
    """residual + x for one chunk of token t's row, rounded once to DT (torch's add), as float32."""
    x = tl.load(X + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    r = tl.load(Residual + t * stride_r + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    return round_to(r + x, DT)


@triton.jit
def _greedy_router_kernel(X, W, Logits, Tickets, Weights, Ids, Sorted_Ids, Block_Expert, Block_Rows,
                          Residual, Norm_W, Normed, Residual_Out,
                          E, H, stride_x, stride_w, stride_r, stride_n, stride_ro, scale, eps,
                          K: tl.constexpr, SHARED: tl.constexpr, RENORM: tl.constexpr, BLOCK_EP: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, ALIGN_BM: tl.constexpr,
                          ADD_NORM: tl.constexpr, ONE_CHUNK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_ep = tl.program_id(1) * BLOCK_EP + tl.arange(0, BLOCK_EP)
    ep_mask = offs_ep < E
    acc = tl.zeros([BLOCK_EP], dtype=tl.float32)
    dt = X.dtype.element_ty
    rstd = 1.0
    if ADD_NORM:  # the row's mean square first (the rmsnorm kernel's float32 arithmetic, its helpers)
        if ONE_CHUNK:  # the whole row is one block: load it once and keep it in registers
            offs_h = tl.arange(0, BLOCK_H)
            whole = _added_row(X, Residual, t, offs_h, offs_h < H, stride_x, stride_r, dt)
            rstd = rms_rstd(tl.sum(whole * whole, 0), H, eps)
        else:
            sq = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                xf = _added_row(X, Residual, t, offs_h, offs_h < H, stride_x, stride_r, dt)
                sq += xf * xf
            rstd = rms_rstd(tl.sum(sq, 0), H, eps)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        if ADD_NORM:
            if ONE_CHUNK:  # noqa: SIM108 - a compile-time branch (`whole` exists only there)
                xf = whole
            else:
                xf = _added_row(X, Residual, t, offs_h, h_mask, stride_x, stride_r, dt)
            nw = tl.load(Norm_W + offs_h, mask=h_mask, other=0.0).to(tl.float32)
            x = rms_weighted(xf, rstd, nw, dt)
            if tl.program_id(1) == 0:  # the token's first program hands the row on to the experts
                tl.store(Normed + t * stride_n + offs_h, x.to(dt), mask=h_mask)
                tl.store(Residual_Out + t * stride_ro + offs_h, xf.to(dt), mask=h_mask)
        else:
            x = tl.load(X + t * stride_x + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs_ep[:, None] * stride_w + offs_h[None, :], mask=ep_mask[:, None] & h_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(Logits + t * E + offs_ep, acc, mask=ep_mask)
    tl.debug_barrier()  # every thread's logit stores before the (single-thread) ticket
    ticket = tl.atomic_add(Tickets + t, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        offs_e = tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        logits = tl.load(Logits + t * E + offs_e, mask=e_mask, other=float("-inf"), cache_modifier=".cg")
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
        row = t * (K + SHARED)
        tl.store(Weights + row + rank, weights, mask=chosen)
        tl.store(Ids + row + rank, offs_e.to(tl.int64), mask=chosen)
        if ALIGN_BM > 0:  # one token: its pairs are one per expert, so one block each (what moe_align would make)
            tl.store(Block_Expert + rank, offs_e, mask=chosen)
            tl.store(Block_Rows + rank, tl.full([BLOCK_E], 1, tl.int32), mask=chosen)
            tl.store(Sorted_Ids + rank * ALIGN_BM, rank, mask=chosen)
        if SHARED > 0:  # the shared experts as always-chosen experts E.., weight 1 (sglx.llm.kernels.fused_moe)
            offs_s = tl.arange(0, BLOCK_S)
            s_mask = offs_s < SHARED
            tl.store(Weights + row + K + offs_s, tl.full([BLOCK_S], 1.0, tl.float32), mask=s_mask)
            tl.store(Ids + row + K + offs_s, (E + offs_s).to(tl.int64), mask=s_mask)
            if ALIGN_BM > 0:
                tl.store(Block_Expert + K + offs_s, E + offs_s, mask=s_mask)
                tl.store(Block_Rows + K + offs_s, tl.full([BLOCK_S], 1, tl.int32), mask=s_mask)
                tl.store(Sorted_Ids + (K + offs_s) * ALIGN_BM, K + offs_s, mask=s_mask)
        tl.atomic_xchg(Tickets + t, 0)


def greedy_router(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                  tickets: torch.Tensor | None = None, interpret: bool = False, shared: int = 0,
                  align_block_m: int = 0, add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  launch: tuple[int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """x [T, H], gate_weight [E, H] -> (weights [T, k] float32, expert ids [T, k] int64, blocks, normed): softmax
    over x @ gate_weight^T in float32, the k best experts, their scores renormalised to sum 1 (`renormalize`) or
    times `scale`. tickets: int32 zeros, at least T of them, that the launch leaves zero (None: fresh ones).
    shared: that many more columns, experts E.. with weight 1 (the shared experts, run by fused_moe).
    align_block_m (one token only): also return fused_moe's expert blocks of that many rows (`moe_align`'s
    (sorted pair ids, block expert, block rows)), written by the same launch; else None.
    add_norm = (residual [T, H], norm weight [H], eps): x is the delta before the post-attention norm; the router
    routes RMSNorm(residual + x) and returns (that normed row, residual + x) last (as `fused_add_rms_norm` does);
    else None there. launch: (experts a program, warps) instead of the default launch (for measurements)."""
    tokens, hidden = x.shape
    experts = gate_weight.shape[0]
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} must be in 1..{experts} (the number of experts)")
    if tickets is not None and (tickets.numel() < tokens or tickets.dtype != torch.int32):
        raise ValueError(f"router tickets: {tokens} int32 zeros needed, got {tickets.numel()} {tickets.dtype}")
    if align_block_m and tokens != 1:
        raise ValueError(f"align_block_m lays out one token's pairs; got {tokens} tokens (use moe_align)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    pairs = top_k + shared
    weights = torch.empty(tokens, pairs, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, pairs, dtype=torch.int64, device=x.device)
    aligned = None
    if align_block_m:  # one block per pair: moe_align's block bound for one token's distinct experts
        aligned = (torch.empty(pairs * align_block_m, dtype=torch.int32, device=x.device),
                   torch.empty(pairs, dtype=torch.int32, device=x.device),
                   torch.empty(pairs, dtype=torch.int32, device=x.device))
    normed = None
    if add_norm is not None:
        residual, norm_weight, eps = add_norm
        if residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (hidden,):
            raise ValueError(f"add_norm: residual {tuple(residual.shape)} {residual.dtype} and norm weight "
                             f"{tuple(norm_weight.shape)} do not fit x {tuple(x.shape)} {x.dtype}")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        normed = (torch.empty_like(x), torch.empty_like(x))
    if tokens == 0:
        return weights, ids, aligned, normed
    if tickets is None:
        tickets = torch.zeros(tokens, dtype=torch.int32, device=x.device)
    logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
    block_e = triton.next_power_of_2(experts)
    if interpret:
        block_h, block_ep = 16, 4
    else:  # the whole row a program where it fits (one load round), as few experts as keep ~32 values a thread
        block_h = min(4096, triton.next_power_of_2(hidden))
        block_ep = max(1, min(block_e, 4096 // block_h))
    warps = 1 if interpret else 4
    if launch is not None:  # (experts a program, warps): benchmarks/bench_moe_router.py's sweep
        block_ep, warps = launch
    res, norm_w, eps = (residual, norm_weight, float(eps)) if add_norm is not None else (x, x, 0.0)
    out_n, out_r = normed if normed is not None else (x, x)
    _greedy_router_kernel[(tokens, triton.cdiv(experts, block_ep))](
        x, gate_weight, logits, tickets, weights, ids, *(aligned or (ids, ids, ids)), res, norm_w, out_n, out_r,
        experts, hidden, x.stride(0), gate_weight.stride(0), res.stride(0), out_n.stride(0), out_r.stride(0),
        float(scale), eps, K=top_k, SHARED=shared, RENORM=renormalize, BLOCK_EP=block_ep, BLOCK_H=block_h,
        BLOCK_E=block_e, BLOCK_S=triton.next_power_of_2(max(shared, 1)), ALIGN_BM=align_block_m,
        ADD_NORM=add_norm is not None, ONE_CHUNK=hidden <= block_h, num_warps=warps)
    return weights, ids, aligned, normed
