"""torch_native MLA: the reference latent-cache backend, PyTorch SDPA over latents gathered via `req_to_token`.

Extend (prefill, cached prefix, MIXED steps) takes the non-absorbed path: each request's latents,
prefix and new tokens alike, are read from the pool and expanded to per-head K/V. Decode takes the
absorbed path: the query moves into latent space (q_nope W_UK), all heads attend over the shared
[c_kv, k_pe] latents as one multi-query head, and W_UV comes after. Any page size, fp8 latents, every
device; not tuned for speed and not CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from sglx.attention.llm.mla_base import (
    MLAAttentionBackend,
    MLALayerSpec,
    MLAProjections,
    absorb_q,
    apply_uv,
    expand_latent,
)
from sglx.attention.llm.torch_native import _SDPA_BACKENDS, step_metadata
from sglx.llm.forward_batch import ForwardBatch


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class TorchNativeMLABackend(MLAAttentionBackend):
    name = "torch_native"
    supports_cuda_graph = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.meta = step_metadata(batch)

    def forward_mla_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        pool = batch.token_kv_pool
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        for i in range(batch.batch_size):
            q_lo, q_hi = meta.qo_indptr[i], meta.qo_indptr[i + 1]
            if q_hi == q_lo:
                continue
            slots = meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]]
            latent = pool.get_latent(layer.layer_id, slots, q.dtype)  # type: ignore[attr-defined]
            keys, values = expand_latent(latent, proj, layer)
            q_pos = torch.arange(q_hi - q_lo, device=q.device) + meta.prefix_lens[i]
            mask = torch.arange(slots.numel(), device=q.device)[None, :] <= q_pos[:, None]
            o = _sdpa(q[q_lo:q_hi].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask,
                      layer.scaling)
            out[q_lo:q_hi] = o.transpose(0, 1)
        return out

    def forward_mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayerSpec,
                           proj: MLAProjections, batch: ForwardBatch) -> torch.Tensor:
        meta = self.meta
        assert meta.decode_slots is not None and meta.decode_valid is not None
        bs, max_len = meta.decode_slots.shape
        q = torch.cat([absorb_q(q_nope, proj), q_pe], dim=-1)  # [bs, H, r + dr]
        latent = batch.token_kv_pool.get_latent(  # type: ignore[attr-defined]
            layer.layer_id, meta.decode_slots.reshape(-1), q.dtype).view(bs, 1, max_len, layer.latent_dim)
        # every head attends over the same latents: the heads are the query rows of one shared KV head
        o_latent = _sdpa(q.unsqueeze(1), latent, latent[..., :layer.kv_lora_rank],
                         meta.decode_valid[:, None, None, :], layer.scaling)  # [bs, 1, H, r]
        return apply_uv(o_latent.squeeze(1), proj)
