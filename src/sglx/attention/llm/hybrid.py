"""Hybrid backend: prefill (EXTEND and MIXED steps) on one backend, DECODE steps on another.

Both backends are built on the same pools, so K/V written by one is read by the other; each step's
metadata is built only by the backend that runs it. This is what `--prefill-attention-backend X
--decode-attention-backend Y` turns into when X and Y differ. Decode CUDA graphs follow the decode backend,
prefill graphs (short single-request prefills, an EXTEND batch) the prefill backend.
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.llm.base import AttentionBackend, BackendContext, LayerSpec
from sglx.attention.llm.kv_store import StepKVSlots
from sglx.llm.forward_batch import ForwardBatch


class HybridAttentionBackend(AttentionBackend):
    name = "hybrid"
    supports_cuda_graph = False

    def __init__(self, ctx: BackendContext, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        super().__init__(ctx)
        self.prefill = prefill
        self.decode = decode
        # decode graphs capture DECODE steps (the decode backend decides), prefill graphs EXTEND steps (the
        # prefill backend decides; the runner captures them only when decode graphs are on too)
        self.supports_cuda_graph = decode.supports_cuda_graph  # type: ignore[misc]
        self.supports_prefill_cuda_graph = prefill.supports_prefill_cuda_graph  # type: ignore[misc]

    def _for(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.mode.is_decode else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._for(batch).init_forward_metadata(batch)

    def step_kv_slots(self, layer: LayerSpec, batch: ForwardBatch) -> StepKVSlots | None:
        return self._for(batch).step_kv_slots(layer, batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self._for(batch).forward(q, k, v, layer, batch, save_kv_cache)

    def forward_mla(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """MLA models: the phase's MLA backend attends over the shared latent pool."""
        batch: ForwardBatch = kwargs["batch"] if "batch" in kwargs else args[6]
        return self._for(batch).forward_mla(*args, **kwargs)  # type: ignore[attr-defined]

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self.prefill.forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self.decode.forward_decode(q, k, v, layer, batch, save_kv_cache)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        self.decode.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        self.decode.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu)

    def init_forward_metadata_in_graph(self, bs: int) -> None:
        self.decode.init_forward_metadata_in_graph(bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode.get_cuda_graph_seq_len_fill_value()

    def init_prefill_graph_state(self, buckets: list[int], qo_indptr: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor) -> None:
        self.prefill.init_prefill_graph_state(buckets, qo_indptr, req_pool_indices, seq_lens)

    def prefill_graph_takes(self, batch: ForwardBatch) -> bool:
        return self.prefill.prefill_graph_takes(batch)

    def init_prefill_metadata_in_graph(self, bucket: int) -> None:
        self.prefill.init_prefill_metadata_in_graph(bucket)

    def init_prefill_metadata_replay(self, bucket: int) -> None:
        self.prefill.init_prefill_metadata_replay(bucket)
