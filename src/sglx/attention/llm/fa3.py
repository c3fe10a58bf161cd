"""fa3: FlashAttention 3 (`flash_attn_interface`, or sgl-kernel's `sgl_kernel.flash_attn`) over the paged pool.

Same contract and the same metadata as fa4 (`fa_metadata.py`): one `flash_attn_with_kvcache` call
per layer reads the pool through the page table with `cache_seqlens`; extend packs queries with
`cu_seqlens_q`, decode runs [bs, 1] queries. FA3 pages natively at any page size. Sliding windows are
FA's (window - 1, 0), the soft-cap FA's `softcap`. fp8 KV is not wired (sglx stores fp8 as bits with a
per-tensor scale; FA3 wants fp8 q/k/v with descales), so fp8 KV is refused before weights load.

NOT VERIFIED on a GPU: neither package installs on the lent H100 (flash-attn-3 has no wheel for
torch 2.11 + CUDA 13, sgl-kernel's wheel is 535 MB, over what a run can carry). What is tested is
the shared metadata (CPU, against a reference and the fa4 path) and the call this module makes
(CPU, against a stand-in that implements FA3's documented contract in float64).
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.llm.base import LayerSpec
from sglx.attention.llm.fa_metadata import FlashMetadata
from sglx.attention.llm.fa_paged import PagedFlashBackend, first_tensor
from sglx.attention.optional_kernels import load_kernel
from sglx.llm.forward_batch import ForwardBatch

KERNEL_MODULES = ("flash_attn_interface", "sgl_kernel.flash_attn")


def window_of(layer: LayerSpec) -> tuple[int, int]:
    """FA3's (left, right), -1 = unbounded; sglx's window w means keys i - w < j <= i."""
    return (layer.sliding_window - 1, 0) if layer.sliding_window else (-1, -1)


class FA3Backend(PagedFlashBackend):
    name = "fa3"

    def _load_kernel(self) -> Any:
        return load_kernel(KERNEL_MODULES, "flash_attn_with_kvcache", "fa3", self.instead)

    def _attend(self, q: torch.Tensor, layer: LayerSpec, batch: ForwardBatch, meta: FlashMetadata,
                decode: bool) -> torch.Tensor:
        k_cache, v_cache = self.paged_cache(layer, batch)
        common: dict[str, Any] = dict(cache_seqlens=meta.seq_lens, page_table=meta.page_table,
                                      softmax_scale=layer.scaling, causal=True, window_size=window_of(layer),
                                      softcap=float(layer.logit_cap))
        if decode:
            bs = q.shape[0]
            out = first_tensor(self.kernel(q.view(bs, 1, *q.shape[1:]), k_cache, v_cache, **common))
            return out.view(bs, layer.num_q_heads, -1)
        return first_tensor(self.kernel(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                                        max_seqlen_q=meta.max_seqlen_q, **common))
