"""Requests whose MLA latents sit on shuffled pages of a latent pool, and one step's ForwardBatch over them.

What `doctor --check`'s MLA problem and the MLA backend tests build: pages handed out in random order (as a
long-running server leaves them), each request's cached prefix stored, and steps that extend or decode
`lo -> hi` tokens of every request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.llm.mla_base import MLAProjections
from sglx.attention.llm.mla_reference import reference_mla
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.mla_kv_cache import MLATokenKVPool


@dataclass
class PagedLatents:
    r2t: ReqToTokenPool
    pool: MLATokenKVPool
    rows: list[int]  # each request's req_to_token row
    latents: list[torch.Tensor]  # each request's [total, kv_lora_rank + rope] latents, in the pool's dtype
    kv_lora_rank: int

    @classmethod
    def build(cls, prefix: list[int], totals: list[int], page: int, kv_lora_rank: int, rope_dim: int,
              dtype: torch.dtype, device: torch.device | str, gen: torch.Generator, layer_id: int = 0,
              num_layers: int = 1) -> PagedLatents:
        """Requests of `totals` tokens on shuffled pages (3 spare), the first `prefix[i]` latents of each stored in
        layer `layer_id`; latents drawn from `gen` (a CPU generator)."""
        num_slots = (sum(-(-t // page) for t in totals) + 3) * page
        r2t = ReqToTokenPool(len(totals) + 1, max(totals) + page, device)
        pool = MLATokenKVPool(num_slots, page, num_layers, kv_lora_rank, rope_dim, dtype, device=device)
        page_ids = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()  # page 0 pads
        rows, latents = [], []
        for t in totals:
            row = r2t.alloc()
            assert row is not None
            mine = [page_ids.pop() for _ in range(-(-t // page))]
            r2t.req_to_token[row, :t] = torch.tensor([p * page + j for p in mine for j in range(page)][:t],
                                                     dtype=torch.int32, device=device)
            rows.append(row)
            latents.append(torch.randn(t, kv_lora_rank + rope_dim, generator=gen).to(device, dtype))
        for row, p, lat in zip(rows, prefix, latents):
            if p:
                pool.set_latent(layer_id, r2t.req_to_token[row, :p].long(), lat[:p, :kv_lora_rank],
                                lat[:p, kv_lora_rank:])
        return cls(r2t, pool, rows, latents, kv_lora_rank)

    def new_latents(self, lo: list[int], hi: list[int]) -> torch.Tensor:
        """The latents of every request's tokens lo..hi, in batch order: what the step stores."""
        return torch.cat([lat[a:b] for lat, a, b in zip(self.latents, lo, hi)])

    def reference(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lo: list[int], hi: list[int], proj: MLAProjections,
                  scale: float) -> torch.Tensor:
        """float64 outputs [T, H, dv] a step must return (`reference_mla`): each request's queries at positions
        lo..hi over its latents 0..hi, in batch order."""
        refs, offset = [], 0
        for lat, a, b in zip(self.latents, lo, hi):
            refs.append(reference_mla(q_nope[offset:offset + b - a], q_pe[offset:offset + b - a], lat[:b], proj.w_uk,
                                      proj.w_uv, torch.arange(a, b), scale))
            offset += b - a
        return torch.cat(refs)

    def step(self, mode: ForwardMode, lo: list[int], hi: list[int], backend: object) -> ForwardBatch:
        """The batch that takes every request from lo to hi tokens (EXTEND, MIXED or DECODE) on `backend`."""
        device = self.r2t.req_to_token.device
        new = [b - a for a, b in zip(lo, hi)]
        return ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=device),
            positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(device),
            req_pool_indices=torch.tensor(self.rows, device=device), seq_lens=torch.tensor(hi, device=device),
            out_cache_loc=torch.cat([self.r2t.req_to_token[r, a:b].long() for r, a, b in zip(self.rows, lo, hi)]),
            req_to_token_pool=self.r2t, token_kv_pool=self.pool, attn_backend=backend,  # type: ignore[arg-type]
            seq_lens_cpu=list(hi), extend_seq_lens_cpu=new if mode.is_extend else [],
            extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])
