"""triton MLA: sglx's Triton kernels over the paged latent cache (DeepSeek-V2/V3).

Decode takes the absorbed path on the split-KV MLA kernel (`kernels/mla_decode.py`): q_nope W_UK and q_pe
against each cached [c_kv, k_pe] row, c_kv as the value, W_UV after; each latent tile is read once per
head block. Extend (prefill, cached prefix, MIXED) takes the non-absorbed path: the batch's latents,
prefix and new tokens alike, are read from the pool and expanded to per-head K/V, which the MHA extend
kernel attends causally; requests are taken in groups whose expansion stays under `max_expanded_bytes`
(one request is never split: a very long context still expands whole). Per-step metadata and the
CUDA-graph hooks are the MHA triton backend's (one latent "KV head"); fp8 latents dequantize in the kernels.
"""

from __future__ import annotations

import torch

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.extend_attention import extend_attention
from sglx.attention.kernels.mla_decode import (
    MLADecodeConfig,
    head_blocks,
    mla_decode_attention,
    mla_num_splits,
    resolve_config,
)
from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import (
    MLAAttentionBackend,
    MLALayerSpec,
    MLAProjections,
    absorb_q,
    apply_uv,
    expand_latent,
    expansion_groups,
)
from sglx.attention.llm.triton import TritonBackend
from sglx.llm.forward_batch import ForwardBatch


class TritonMLABackend(MLAAttentionBackend, TritonBackend):
    """MLA entry points from MLAAttentionBackend; metadata, CUDA-graph hooks and kernel configs from TritonBackend."""

    name = "triton"
    supports_cuda_graph = True
    # Prefill graphs: the extend expands every key's latent per head, and a graph fixes how many. A bucket's graph
    # expands its own rows plus `graph_prefix_cap` keys of cached prefix (the largest bucket), so any prompt whose
    # cached prefix is no longer than that replays it (`prefill_graph_takes`); longer prefixes prefill eagerly.
    supports_prefill_cuda_graph = True
    mla_decode_config = MLADecodeConfig()
    max_expanded_bytes = 1 << 30  # per-head K/V expanded at once by one extend launch (more requests: more launches)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.graph_prefix_cap = 0  # cached-prefix keys a prefill graph expands (set with the graphs' state)
        self._graph_bucket = 0  # the prefill graph being captured or stepped (0: an eager step)
        self.mla_config = resolve_config(self.mla_decode_config, ctx.num_q_heads,
                                         getattr(ctx.token_kv_pool, "fp8_dtype", None) is not None, ctx.device,
                                         self.interpret)

    def _programs_per_split(self) -> int:
        """The MLA kernel runs one program per head block (all heads share the one latent 'KV head')."""
        return head_blocks(self.ctx.num_q_heads, self.mla_config)

    def _graph_splits(self, bs: int, max_context: int) -> int:
        """MLA's split policy (one split once the batch fills the GPU), for eager steps and graph buffers alike."""
        return mla_num_splits(bs, self.ctx.num_q_heads, max_context, num_sms(self.ctx.device), self.mla_config)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._graph_bucket = 0
        super().init_forward_metadata(batch)

    def init_prefill_graph_state(self, buckets: list[int], qo_indptr: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor) -> None:
        super().init_prefill_graph_state(buckets, qo_indptr, req_pool_indices, seq_lens)
        self.graph_prefix_cap = min(max(buckets), self.ctx.req_to_token_pool.max_context_len)  # within kv_indices

    def init_prefill_metadata_in_graph(self, bucket: int) -> None:
        super().init_prefill_metadata_in_graph(bucket)
        self._graph_bucket = bucket

    def init_prefill_metadata_replay(self, bucket: int) -> None:
        super().init_prefill_metadata_replay(bucket)
        self._graph_bucket = bucket

    def prefill_graph_takes(self, batch: ForwardBatch) -> bool:
        """Prefills whose cached prefix fits the keys a graph expands beyond its bucket."""
        return sum(batch.extend_prefix_lens_cpu) <= self.graph_prefix_cap

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        assert meta is not None and meta.mid_o is not None and meta.mid_lse is not None, \
            "init_forward_metadata(batch) must run first"
        pool = batch.token_kv_pool
        # the decode kernel reads q_lat and q_pe where they lie: no torch.cat
        q_lat = absorb_q(q_nope, proj, kernel=True, interpret=self.interpret)
        o_latent = q_lat.new_empty((q_lat.shape[0], layer.num_heads, layer.kv_lora_rank))
        mla_decode_attention(
            q_lat, pool.kv_buffer[layer.layer_id], o_latent, meta.kv_indptr, meta.kv_indices,  # type: ignore[union-attr]
            meta.mid_o, meta.mid_lse, layer.scaling, layer.kv_lora_rank,
            kv_scale=pool.kv_scale[layer.layer_id], fp8_dtype=pool.fp8_dtype,  # type: ignore[union-attr]
            config=self.mla_config, interpret=self.interpret, q_pe=q_pe)
        return apply_uv(o_latent, proj, q_lat.new_empty((q_lat.shape[0], layer.num_heads, layer.v_head_dim)),
                        kernel=True, interpret=self.interpret)

    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        if self._graph_bucket:
            self._extend_in_graph(q, out, layer, proj, batch)
            return out
        for group in self._extend_groups(batch, layer, q.element_size()):
            self._extend_group(q, out, group, layer, proj, batch)
        return out

    def _extend_in_graph(self, q: torch.Tensor, out: torch.Tensor, layer: MLALayerSpec, proj: MLAProjections,
                         batch: ForwardBatch) -> None:
        """A prefill graph's extend, shapes fixed by the bucket: the first bucket + graph_prefix_cap entries of the
        static kv_indices (the real request's prefix and rows, the padding request's rows, then unused entries that
        hold valid slots) are expanded; the kernel reads only the keys kv_indptr gives each request."""
        meta = self.meta
        assert meta is not None and meta.qo_indptr is not None
        self._attend_expanded(q, out, meta.kv_indices[:self._graph_bucket + self.graph_prefix_cap], meta.qo_indptr,
                              meta.kv_indptr, self._graph_bucket, 0, layer, proj, batch)

    def _attend_expanded(self, q: torch.Tensor, out: torch.Tensor, kv_slots: torch.Tensor, qo_indptr: torch.Tensor,
                         kv_indptr: torch.Tensor, max_q: int, prefix_tokens: int, layer: MLALayerSpec,
                         proj: MLAProjections, batch: ForwardBatch) -> None:
        """The latents at `kv_slots` expanded to per-head K/V (row i = slot i), attended by q through the MHA extend
        kernel with the given indptrs (offsets into q and into kv_slots)."""
        latent = batch.token_kv_pool.get_latent(layer.layer_id, kv_slots.long(), q.dtype)  # type: ignore[attr-defined]
        keys, values = expand_latent(latent, proj, layer)
        rows = torch.arange(keys.shape[0], dtype=torch.int32, device=q.device)  # expanded rows, in kv order
        extend_attention(q, keys, values, out, qo_indptr, kv_indptr, rows, max_q, layer.scaling,
                         config=self.extend_config, interpret=self.interpret, prefix_tokens=prefix_tokens)

    def _extend_groups(self, batch: ForwardBatch, layer: MLALayerSpec, elem: int) -> list[range]:
        """Consecutive request ranges whose expanded K/V fit max_expanded_bytes (at least one request each)."""
        return expansion_groups(batch.seq_lens_cpu, layer, elem, self.max_expanded_bytes)

    def _extend_group(self, q: torch.Tensor, out: torch.Tensor, group: range, layer: MLALayerSpec,
                      proj: MLAProjections, batch: ForwardBatch) -> None:
        """Expand the group's latents (prefix + new) per head and run the MHA extend kernel on them."""
        meta = self.meta
        assert meta is not None and meta.qo_indptr is not None
        q_lens, kv_lens = batch.extend_seq_lens_cpu[group.start:group.stop], batch.seq_lens_cpu[group.start:group.stop]
        q_lo = sum(batch.extend_seq_lens_cpu[:group.start])
        kv_lo = sum(batch.seq_lens_cpu[:group.start])
        q_hi, kv_hi = q_lo + sum(q_lens), kv_lo + sum(kv_lens)
        if len(group) == batch.batch_size:
            qo_indptr, kv_indptr = meta.qo_indptr, meta.kv_indptr
        else:
            qo_indptr = meta.qo_indptr[group.start:group.stop + 1] - q_lo
            kv_indptr = meta.kv_indptr[group.start:group.stop + 1] - kv_lo
        self._attend_expanded(q[q_lo:q_hi], out[q_lo:q_hi], meta.kv_indices[kv_lo:kv_hi], qo_indptr, kv_indptr,
                              max(q_lens, default=0), sum(kv_lens) - sum(q_lens), layer, proj, batch)
