"""One token's MoE experts as GEMVs on the CUDA cores: gate_up with SiLU-and-mul, then down with the top-k sum.

Why: at batch 1 a MoE layer streams its chosen experts' weights once (DeepSeek-V2-Lite: 6 routed + 2 shared experts,
138 MB), and fused_moe's `tl.dot` GEMMs pad the token's row to a 16-row block and add a launch for the top-k sum.
Here (1) a program per (pair, feature block) gathers the gate rows and the up rows of its features of the pair's
expert into one tile (sglx.llm.kernels.gemv's loop) and writes silu(gate) * up; (2) a program per block of output
features walks the token's pairs, adding each expert's down product times its routing weight in float32, and
writes the sum in the model dtype (+ `add`): no float32 [pairs, H] buffer, no sum launch. The arithmetic is
fused_moe's (silu(g) * u in float32 rounded once; the weighted products summed in float32 in pair order, rounded
once). Shared experts ride along as experts E.. (fused_moe's `shared` layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.llm.kernels.gemv import GemvConfig, halves, launch_params, row_products
from sglx.llm.kernels.rounding import round_to


@triton.jit
def _gate_up_kernel(X, W13, S13, Ids, Inter, H, N_INTER, num_routed, stride_we, stride_wn, s_stride_e, s_stride_n,
                    s_up, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    expert = tl.load(Ids + pair).to(tl.int64)
    W = W13 + expert * stride_we
    stride_n = stride_wn
    up = N_INTER
    if expert >= num_routed:  # a shared expert: an I-wide slice of the shared MLP's [gate; up] weight
        W = S13 + (expert - num_routed) * s_stride_e
        stride_n = s_stride_n
        up = s_up
    lane = tl.arange(0, 2 * BLOCK_P)  # BLOCK_P gate rows, then the up rows of the same features
    feature = tl.program_id(1) * BLOCK_P + lane % BLOCK_P
    row = feature + (lane // BLOCK_P) * up
    y = row_products(X, W + row[:, None].to(tl.int64) * stride_n, feature < N_INTER, H, BLOCK_K)
    g, u = halves(y, BLOCK_P)
    offs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    dt = Inter.dtype.element_ty
    tl.store(Inter + pair * N_INTER + offs, round_to(g / (1.0 + tl.exp(-g)) * u, dt).to(dt), mask=offs < N_INTER)


@triton.jit
def _down_sum_kernel(Inter, W2, S2, Ids, Routed_W, Add, Out, H, N_INTER, pairs, num_routed, stride_we, stride_wn,
                     s_stride_n, HAS_ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for pair in range(0, pairs):
        expert = tl.load(Ids + pair).to(tl.int64)
        rows = W2 + expert * stride_we + offs[:, None].to(tl.int64) * stride_wn
        if expert >= num_routed:  # a shared expert: its I columns of the shared down weight [H, S I]
            rows = S2 + (expert - num_routed) * N_INTER + offs[:, None].to(tl.int64) * s_stride_n
        acc += row_products(Inter + pair * N_INTER, rows, mask, N_INTER, BLOCK_K) * tl.load(Routed_W + pair)
    dt = Out.dtype.element_ty
    out = round_to(acc, dt)
    if HAS_ADD:
        out = round_to(out + tl.load(Add + offs, mask=mask, other=0.0).to(tl.float32), dt)
    tl.store(Out + offs, out.to(dt), mask=mask)


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             add: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
             config: GemvConfig = GemvConfig(), interpret: bool = False) -> torch.Tensor:
    """fused_moe for one token: x [1, H], w13 [E, 2I, H], w2 [E, H, I], routing weights/ids [1, k] (ids E + s for
    shared expert s, as fused_moe takes them) -> sum_k w * expert(x) [1, H] in x's dtype (+ `add`, rounded again)."""
    tokens, hidden = x.shape
    if tokens != 1:
        raise ValueError(f"moe_gemv runs one token, got {tokens} (use fused_moe)")
    experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    pairs = ids.numel()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_gemv needs expert weights with contiguous rows")
    s13, s2 = shared if shared is not None else (w13, w2)
    n_shared = s2.shape[1] // inter_size if shared is not None else 0
    x1 = x.reshape(hidden).contiguous()
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    ids1 = ids.reshape(-1).contiguous()
    routing = weights.reshape(-1).float().contiguous()
    block_n, block_k, warps, stages = launch_params(pairs * two_i, hidden, config, interpret)
    block_p = max(1, block_n // 2)
    _gate_up_kernel[(pairs, triton.cdiv(inter_size, block_p))](
        x1, w13, s13, ids1, inter, hidden, inter_size, experts, w13.stride(0), w13.stride(1),
        inter_size * s13.stride(0), s13.stride(0), n_shared * inter_size,
        BLOCK_P=block_p, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    out = torch.empty_like(x1)
    if add is not None:
        add = add.reshape(hidden).contiguous()
    block_n, block_k, warps, stages = launch_params(hidden, inter_size, config, interpret)
    _down_sum_kernel[(triton.cdiv(hidden, block_n),)](
        inter, w2, s2, ids1, routing, add if add is not None else out, out, hidden, inter_size, pairs, experts,
        w2.stride(0), w2.stride(1), s2.stride(0), HAS_ADD=add is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out.view(1, hidden)
