"""fa4: FlashAttention 4 (`flash_attn.cute`, the CuTe DSL kernels of flash-attn-4) over the paged pool.

One `flash_attn_varlen_func` call per layer reads the pool in place through the page table:
extend packs the step's queries with `cu_seqlens_q` and sees each request's cached prefix plus its
new tokens (`seqused_k`), decode runs [bs, 1] queries. Causal masks align queries to the end of
each request's keys; sliding windows are FA's (window - 1, 0) and the logit soft-cap FA's `softcap`.

Hopper (SM90) reads pages with TMA only when a page is one 128-key tile, and the seed's rule is
`page_size` 128 there, so any other page size is refused (auto picks 128). SM90 has no split-KV in
FA4 (the kernel asserts), so every call runs `num_splits=1`: decode gets one CTA per (request, KV
head) and slows down with context at small batch, as SGLang's docs warn. That also keeps decode
capturable in CUDA graphs: the page table and lengths live in fixed buffers refilled inside the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.llm.fa_metadata import FlashMetadata
from sglx.attention.llm.fa_paged import PagedFlashBackend, first_tensor
from sglx.attention.optional_kernels import load_kernel
from sglx.llm.forward_batch import ForwardBatch

SM90_PAGE_SIZE = 128


def window_of(layer: LayerSpec) -> tuple[int | None, int | None]:
    """FA4's (left, right): keys j with i - left <= j <= i; sglx's window w means i - w < j <= i."""
    return (layer.sliding_window - 1, 0) if layer.sliding_window else (None, None)


class FA4Backend(PagedFlashBackend):
    name = "fa4"

    def _check_page_size(self, ctx: BackendContext) -> None:
        cc = torch.cuda.get_device_capability(ctx.device)
        if cc[0] == 9 and ctx.page_size != SM90_PAGE_SIZE:
            raise self._fail(f"on SM90 ({torch.cuda.get_device_name(ctx.device)}) FA4 reads the KV cache in pages of "
                             f"{SM90_PAGE_SIZE} tokens, and --page-size is {ctx.page_size}",
                             f"--page-size {SM90_PAGE_SIZE} (or leave it unset)")

    def _load_kernel(self) -> Any:
        return load_kernel("flash_attn.cute", "flash_attn_varlen_func", "fa4", self.instead)

    def _attend(self, q: torch.Tensor, layer: LayerSpec, batch: ForwardBatch, meta: FlashMetadata,
                decode: bool) -> torch.Tensor:
        k_cache, v_cache = self.paged_cache(layer, batch)
        common: dict[str, Any] = dict(seqused_k=meta.seq_lens, page_table=meta.page_table, softmax_scale=layer.scaling,
                                      causal=True, window_size=window_of(layer), softcap=float(layer.logit_cap),
                                      num_splits=1)
        if decode:
            bs = q.shape[0]
            out = first_tensor(self.kernel(q.view(bs, 1, *q.shape[1:]), k_cache, v_cache, **common))
            return out.view(bs, layer.num_q_heads, -1)
        out = first_tensor(self.kernel(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                       max_seqlen_q=meta.max_seqlen_q, **common))
        return out
