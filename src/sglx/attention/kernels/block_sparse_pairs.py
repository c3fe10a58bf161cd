"""Block-sparse attention over 64-token query blocks taken two at a time: a key block both blocks list is loaded once.

Why: with VSA's 64-token cubes the block-sparse kernel reads every listed key block once per 64 query rows; at
18x48x80 (12 heads, 135 of 1,080 key blocks a row) that is about 56 GB of K/V tiles a call, the kernel runs at
0.70 of cuDNN's dense efficiency, and 128-row tiles (STA's) run at 0.86 (session 29). One program here owns two
neighbouring query blocks A and B. It walks the key blocks only A lists and those only B lists with 64-row
tiles, then joins both halves' online-softmax states and walks the key blocks both list with one 128-row tile:
each key block is loaded once per program, and the shared ones feed a tile twice as tall. The mask is exactly
the layout's (every query row attends exactly its own block's keys); only the order of the key blocks differs.

`pair_lists` splits a layout's rows into the three lists per pair. TMA K/V loads (SM90+), head dim 64/128,
fp16/bf16, layouts of 64x64 blocks without padded keys (a partial last block is masked by `seq_len`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.kernels.common import LOG2E

BLOCK = 64  # query and key block (VSA's cubes)


@triton.jit
def _attend(q, m_i, l_i, acc, lst, count, K_desc, V_desc, row0, col, seq_len, qk_scale,
            BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr):
    """Online softmax of q's rows over the `count` key blocks listed at `lst` (one flat, pipelined loop)."""
    offs_n = tl.arange(0, BLOCK_N)
    for it in range(0, count):
        start = tl.load(lst + it) * BLOCK_N
        k = K_desc.load([row0 + start, col])
        v = V_desc.load([row0 + start, col])
        qk = tl.dot(q, tl.trans(k))
        if MASK_KEYS:
            qk = tl.where(((start + offs_n) < seq_len)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _rows(a, b, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """[BLOCK_M, D] a over [BLOCK_M, D] b -> [2 * BLOCK_M, D]."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * BLOCK_M, D))


@triton.jit
def _stack(a, b, BLOCK_M: tl.constexpr):
    """[BLOCK_M] a then [BLOCK_M] b -> [2 * BLOCK_M]."""
    return tl.reshape(tl.permute(tl.join(a, b), (1, 0)), (2 * BLOCK_M,))


@triton.jit
def _block_sparse_pairs_tma(
    Q, K_desc, V_desc, Out, Lists, Counts,
    qk_scale, seq_len, num_heads, row_b, row_h, col_h,
    stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_lp, stride_lk, stride_cb, stride_ch, stride_cp,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KEYS: tl.constexpr,
):
    pair = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    head = bh % num_heads
    kv_head = head // GROUP
    m0 = pair * 2 * BLOCK_M
    offs_d = tl.arange(0, D)
    offs_a = m0 + tl.arange(0, BLOCK_M)
    offs_b = offs_a + BLOCK_M
    q_base = Q + b.to(tl.int64) * stride_qb + head * stride_qh
    qa = tl.load(q_base + offs_a[:, None].to(tl.int64) * stride_qs + offs_d[None, :],
                 mask=(offs_a < seq_len)[:, None], other=0.0)
    qb = tl.load(q_base + offs_b[:, None].to(tl.int64) * stride_qs + offs_d[None, :],
                 mask=(offs_b < seq_len)[:, None], other=0.0)
    lists = Lists + b * stride_lb + head * stride_lh + pair * stride_lp
    counts = Counts + b * stride_cb + head * stride_ch + pair * stride_cp
    row0 = b * row_b + kv_head * row_h
    col = kv_head * col_h

    m_a = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_a = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_a, l_a, acc_a = _attend(qa, m_a, l_a, acc_a, lists, tl.load(counts), K_desc, V_desc, row0, col, seq_len,
                              qk_scale, BLOCK_M, MASK_KEYS)
    m_b = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_b = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_b, l_b, acc_b = _attend(qb, m_b, l_b, acc_b, lists + stride_lk, tl.load(counts + 1), K_desc, V_desc, row0,
                              col, seq_len, qk_scale, BLOCK_M, MASK_KEYS)
    # both halves as one 128-row tile over the key blocks A and B share
    m_i, l_i, acc = _attend(_rows(qa, qb, BLOCK_M, D), _stack(m_a, m_b, BLOCK_M), _stack(l_a, l_b, BLOCK_M),
                            _rows(acc_a, acc_b, BLOCK_M, D), lists + 2 * stride_lk, tl.load(counts + 2), K_desc,
                            V_desc, row0, col, seq_len, qk_scale, BLOCK_M, MASK_KEYS)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    offs_m = m0 + tl.arange(0, 2 * BLOCK_M)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_os + head * stride_oh
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=(offs_m < seq_len)[:, None])


def pair_lists(layout: BlockSparseLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(lists int32 [B, H, pairs, 3, width], counts int32 [B, H, pairs, 3]): for query blocks 2p (A) and 2p + 1 (B),
    the key blocks only A lists, only B lists, and both list, each ascending (-1 past its count). An odd last
    block pairs with an empty one."""
    mask = layout.block_mask()  # [B, H, nq, nk]
    if mask.shape[2] % 2:
        mask = torch.nn.functional.pad(mask, (0, 0, 0, 1))
    a, b = mask[:, :, 0::2], mask[:, :, 1::2]
    parts = torch.stack([a & ~b, b & ~a, a & b], 3)  # [B, H, P, 3, nk]
    width = layout.kv_indices.shape[-1]
    pos = torch.where(parts, parts.cumsum(-1, dtype=torch.int32) - 1, width)
    cols = torch.arange(parts.shape[-1], device=mask.device, dtype=torch.int32).expand_as(pos)
    lists = torch.full((*parts.shape[:-1], width + 1), -1, dtype=torch.int32, device=mask.device)
    lists.scatter_(-1, pos.long(), cols)
    return lists[..., :width].contiguous(), parts.sum(-1, dtype=torch.int32).contiguous()


def serves(q: torch.Tensor, layout: BlockSparseLayout) -> bool:
    """Layouts and inputs the pair kernel takes (else the one-block kernel runs)."""
    from sglx.attention.kernels.common import has_tma

    return (layout.q_block == BLOCK and layout.k_block == BLOCK and layout.k_lengths is None and q.dim() == 4
            and q.shape[-1] in (64, 128) and q.dtype in (torch.float16, torch.bfloat16) and has_tma(q.device))


def block_sparse_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                       scale: float | None = None, *, num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] in layout order -> [B, S, Hq, D], the same output as
    `block_sparse_attention` (call `serves` first)."""
    from sglx.attention.kernels.block_sparse_attention import _check, _kv_descriptors

    _check(q, k, v, layout)
    b, s, hq, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    lists, counts = pair_lists(layout)
    (k_desc, v_desc), (row_b, row_h, col_h) = _kv_descriptors(k, v, BLOCK)
    scale = d ** -0.5 if scale is None else scale
    grid = (lists.shape[2], b * hq)
    _block_sparse_pairs_tma[grid](
        q, k_desc, v_desc, out, lists, counts, float(scale) * LOG2E, s, hq, row_b, row_h, col_h,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lists.stride(0) if lists.shape[0] > 1 else 0, lists.stride(1) if lists.shape[1] > 1 else 0,
        lists.stride(2), lists.stride(3),
        counts.stride(0) if counts.shape[0] > 1 else 0, counts.stride(1) if counts.shape[1] > 1 else 0,
        counts.stride(2),
        GROUP=hq // k.shape[2], D=d, BLOCK_M=BLOCK, MASK_KEYS=s % BLOCK != 0, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


__all__ = ["BLOCK", "block_sparse_pairs", "pair_lists", "serves"]
