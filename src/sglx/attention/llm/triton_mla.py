"""triton MLA: sglx's Triton kernels over the paged latent cache (DeepSeek-V2/V3).

Decode takes the absorbed path on the split-KV MLA kernel (`kernels/mla_decode.py`): q_nope W_UK and q_pe
against each cached [c_kv, k_pe] row, c_kv as the value, W_UV after; each latent tile is read once per
head block. Extend (prefill, cached prefix, MIXED) takes the non-absorbed path: the batch's latents,
prefix and new tokens alike, are read from the pool and expanded to per-head K/V, which the MHA extend
kernel attends causally. Per-step metadata and the CUDA-graph hooks are the MHA triton backend's (one
latent "KV head"); fp8 latents dequantize in the kernels.
"""

from __future__ import annotations

import torch

from sglx.attention.kernels.extend_attention import extend_attention
from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention
from sglx.attention.llm.base import LayerSpec
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections, absorb_q, apply_uv, expand_latent
from sglx.attention.llm.triton import TritonBackend
from sglx.llm.forward_batch import ForwardBatch


class TritonMLABackend(TritonBackend):
    name = "triton"
    supports_cuda_graph = True
    mla_decode_config = MLADecodeConfig()

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                    layer: MLALayerSpec, proj: MLAProjections, batch: ForwardBatch,
                    save_kv_cache: bool = True) -> torch.Tensor:
        """Store this step's latents, attend; returns [T, H, v_head_dim]."""
        pool = batch.token_kv_pool
        if save_kv_cache:
            pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)  # type: ignore[attr-defined]
        meta = self.meta
        assert meta is not None, "init_forward_metadata(batch) must run first"
        if batch.mode.is_decode:
            assert meta.mid_o is not None and meta.mid_lse is not None
            q = torch.cat([absorb_q(q_nope, proj), q_pe], dim=-1)
            o_latent = q.new_empty((q.shape[0], layer.num_heads, layer.kv_lora_rank))
            mla_decode_attention(
                q, pool.kv_buffer[layer.layer_id], o_latent, meta.kv_indptr, meta.kv_indices,  # type: ignore[attr-defined]
                meta.mid_o, meta.mid_lse, layer.scaling, layer.kv_lora_rank,
                kv_scale=pool.kv_scale[layer.layer_id], fp8_dtype=pool.fp8_dtype,  # type: ignore[attr-defined]
                config=self.mla_decode_config, interpret=self.interpret)
            return apply_uv(o_latent, proj)
        assert meta.qo_indptr is not None
        q = torch.cat([q_nope, q_pe], dim=-1)
        latent = pool.get_latent(layer.layer_id, meta.kv_indices.long(), q.dtype)  # type: ignore[attr-defined]
        keys, values = expand_latent(latent, proj, layer)
        rows = torch.arange(keys.shape[0], dtype=torch.int32, device=q.device)  # expanded rows, in kv_indptr order
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        return extend_attention(q, keys, values, out, meta.qo_indptr, meta.kv_indptr, rows, meta.max_extend_len,
                                layer.scaling, config=self.extend_config, interpret=self.interpret,
                                prefix_tokens=meta.prefix_tokens)

    # An MLA backend attends over latents; the MHA entry points are a programming error, said so loudly.
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        raise TypeError(f"{self.name} MLA backend: call forward_mla (an MHA model needs an MHA backend)")

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                       batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        raise TypeError(f"{self.name} MLA backend: call forward_mla (an MHA model needs an MHA backend)")
