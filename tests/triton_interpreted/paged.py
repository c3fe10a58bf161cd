"""Test helpers for the Triton kernels: a float64 attention reference and a scattered paged KV cache.

Shared by the interpreted CPU cases and the GPU tests, so both check against the same definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                        window: int | None = None, cap: float = 0.0) -> torch.Tensor:
    """float64 causal attention of one request: q [Lq, Hq, D] at positions q_pos, k/v [Lk, Hkv, D] at 0..Lk-1."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, 1)
    v64 = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    if cap > 0:
        scores = cap * torch.tanh(scores / cap)
    k_pos = torch.arange(k.shape[0], device=k.device)
    q_pos = q_pos.to(k.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v64)


@dataclass
class PagedCache:
    """Requests whose tokens live on shuffled pages of one layer; keys/values are what the pool returns."""

    r2t: ReqToTokenPool
    pool: TokenKVPool
    rows: list[int]
    keys: list[torch.Tensor]  # per request [len, Hkv, D], the values the pool holds (dequantized)
    values: list[torch.Tensor]
    raw_keys: list[torch.Tensor]  # per request, before quantization
    raw_values: list[torch.Tensor]

    def slots(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.r2t.req_to_token[self.rows[i], lo:hi].long()

    def store_new(self, prefix: list[int], scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each request's tokens past prefix[i] with store_kv, as an extend step does; return their raw K/V."""
        from sglx.attention.kernels.store_kv import store_kv

        loc = torch.cat([self.slots(i, p, len(k)) for i, (p, k) in enumerate(zip(prefix, self.raw_keys))])
        k_new = torch.cat([k[p:] for k, p in zip(self.raw_keys, prefix)])
        v_new = torch.cat([v[p:] for v, p in zip(self.raw_values, prefix)])
        store_kv(k_new, v_new, self.pool.k_buffer[0], self.pool.v_buffer[0], loc, *scales, self.pool.fp8_dtype)
        return k_new, v_new


def make_paged_cache(lens: list[int], page: int, hkv: int, dim: int, dtype: torch.dtype, *, device: str = "cpu",
                     kv_cache_dtype: str = "auto", scales: tuple[float, float] = (1.0, 1.0), seed: int = 0,
                     fill: list[int] | None = None, dim_v: int | None = None) -> PagedCache:
    """Allocate `lens` tokens per request on random pages; store the first `fill[i]` of them (all by default)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    num_slots = (sum(pages) + 2) * page
    r2t = ReqToTokenPool(len(lens) + 1, max(lens) + page, device)
    pool = TokenKVPool(num_slots, page, 1, hkv, dim, dtype, kv_cache_dtype=kv_cache_dtype, device=device,
                       v_head_dim=dim_v)
    pool.k_scale[0], pool.v_scale[0] = scales
    free = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()  # page 0 is padding
    cache = PagedCache(r2t, pool, [], [], [], [], [])
    for i, n in enumerate(lens):
        row = r2t.alloc()
        assert row is not None
        mine = [free.pop() for _ in range(pages[i])]
        slots = torch.tensor([p * page + j for p in mine for j in range(page)][:n], dtype=torch.int32)
        r2t.req_to_token[row, :n] = slots.to(device)
        k = (torch.randn(n, hkv, dim, generator=gen) * 1.5).to(device, dtype)
        v = torch.randn(n, hkv, dim_v or dim, generator=gen).to(device, dtype)
        stored = n if fill is None else fill[i]
        if stored:
            pool.set_kv(0, slots[:stored].long().to(device), k[:stored], v[:stored])
        kq = pool.decode(pool._encode(k, scales[0]), scales[0], dtype) if pool.is_fp8 else k
        vq = pool.decode(pool._encode(v, scales[1]), scales[1], dtype) if pool.is_fp8 else v
        cache.rows.append(row)
        cache.keys.append(kq)
        cache.values.append(vq)
        cache.raw_keys.append(k)
        cache.raw_values.append(v)
    return cache


def step_batch(cache, mode: ForwardMode, lo: list[int], new: list[int]) -> ForwardBatch:  # noqa: ANN001
    """The step that adds new[i] tokens after lo[i] cached ones for each request of `cache` (any object with
    r2t, pool, rows and slots(i, lo, hi), e.g. PagedCache)."""
    hi = [a + n for a, n in zip(lo, new)]
    loc = torch.cat([cache.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))])
    extend = mode.is_extend
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long),
        positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]),
        req_pool_indices=torch.tensor(cache.rows), seq_lens=torch.tensor(hi), out_cache_loc=loc,
        req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=hi,
        extend_seq_lens_cpu=list(new) if extend else [], extend_prefix_lens_cpu=list(lo) if extend else [],
    )
