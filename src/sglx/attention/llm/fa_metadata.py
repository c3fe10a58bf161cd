"""Page-table metadata for the FlashAttention backends (fa3, fa4): one builder, two kernels.

FlashAttention reads a paged cache as `[num_pages, page_size, Hkv, D]` through a per-request page
table, so `page_table[i, j]` must be the page holding request i's tokens j*ps .. j*ps + ps - 1. sglx's
pool is exactly that layout (`k_buffer[layer]` has (num_pages + 1) * ps rows) and the allocator keeps
each page's tokens in order (a request's token at position p sits at offset p % ps of its page; the
radix cache shares whole pages only), so the table is every ps-th entry of `req_to_token`, divided by
ps. `seqused_k` (FA4) / `cache_seqlens` (FA3) are the requests' lengths, `cu_seqlens_q` the query
offsets of an extend step. Everything is built with device ops from the batch's tensors: no host
sync, and the CUDA-graph variant writes into fixed buffers inside the captured region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.llm.forward_batch import ForwardBatch


@dataclass
class FlashMetadata:
    """One step's plan, shared by every layer; under CUDA graphs the tensors are views of static buffers."""

    page_table: torch.Tensor  # [bs, max_pages] int32 page ids (entries past a request's length are unused)
    seq_lens: torch.Tensor  # [bs] int32: keys per request, this step's tokens included
    max_seqlen_k: int  # upper bound of seq_lens (page_table width * page_size in graphs)
    cu_seqlens_q: torch.Tensor | None = None  # extend: [bs + 1] int32 query offsets
    max_seqlen_q: int = 1


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def build_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, num_pages: int, page_size: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """[bs, num_pages] int32: page ids of the first num_pages pages of each request's row of req_to_token."""
    firsts = req_to_token[:, ::page_size][:, :num_pages]  # slot of token j*ps (a view, nothing copied yet)
    rows = torch.index_select(firsts, 0, req_pool_indices.to(device=req_to_token.device, dtype=torch.long))
    table = rows // page_size if page_size > 1 else rows
    if out is None:
        return table.to(torch.int32).contiguous()
    out.copy_(table)
    return out


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[n + 1] int32 running offsets of `lengths` (built on the host, one copy)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def build_flash_metadata(batch: ForwardBatch, page_size: int, device: torch.device) -> FlashMetadata:
    """Eager metadata of one step: the page table only as wide as this step's longest request."""
    max_len = max(batch.seq_lens_cpu, default=0)
    table = build_page_table(batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
                             max(1, pages_for(max_len, page_size)), page_size)
    seq_lens = batch.seq_lens.to(device=device, dtype=torch.int32)
    meta = FlashMetadata(table, seq_lens, max_len)
    if not batch.mode.is_decode:
        meta.cu_seqlens_q = cu_seqlens(batch.extend_seq_lens_cpu, device)
        meta.max_seqlen_q = max(batch.extend_seq_lens_cpu, default=0)
    return meta


@dataclass
class FlashGraphState:
    """Static decode metadata for CUDA graphs: one table and one length buffer for every captured bucket."""

    page_table: torch.Tensor  # [max_bs, max_pages] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    max_pages: int
    page_size: int
    metas: dict[int, FlashMetadata]
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # bs -> the graph's static (req_pool_indices, seq_lens)

    @classmethod
    def allocate(cls, max_bs: int, max_context: int, page_size: int, device: torch.device) -> FlashGraphState:
        max_pages = pages_for(max_context, page_size)
        return cls(torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
                   torch.ones(max_bs, dtype=torch.int32, device=device), max_pages, page_size, {}, {})

    def capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> FlashMetadata:
        """Views for a bucket of bs requests; the graph fills them from its static inputs on every replay."""
        meta = FlashMetadata(self.page_table[:bs], self.seq_lens[:bs], self.max_pages * self.page_size)
        self.metas[bs] = meta
        self.inputs[bs] = (req_pool_indices, seq_lens)
        return meta

    def fill(self, bs: int, req_to_token: torch.Tensor) -> FlashMetadata:
        """Device work captured into the graph: the page table and lengths from the static inputs."""
        req_pool_indices, seq_lens = self.inputs[bs]
        meta = self.metas[bs]
        build_page_table(req_to_token, req_pool_indices, self.max_pages, self.page_size, out=meta.page_table)
        meta.seq_lens.copy_(seq_lens)
        return meta
