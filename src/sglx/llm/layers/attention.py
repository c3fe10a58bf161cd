"""sglx's attention layer: q/k/v in, the selected backend's output out.

The module owns no weights; it carries the layer's `LayerSpec` so the backend knows which KV buffer,
head layout, scale and window this layer uses, and it hands the step's `ForwardBatch` through.
"""

from __future__ import annotations

import torch
from torch import nn

from sglx.attention.llm.base import LayerSpec
from sglx.llm.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        """q [T, Hq*D] or [T, Hq, D], k/v [T, Hkv*D] or [T, Hkv, D] -> [T, Hq*D]."""
        if batch.attn_backend is None:
            raise RuntimeError("ForwardBatch.attn_backend is not set; the model runner must attach a backend")
        spec = self.spec
        tokens = q.shape[0]
        q = q.reshape(tokens, spec.num_q_heads, spec.head_dim)
        k = k.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(tokens, spec.num_kv_heads, spec.head_dim)
        out = batch.attn_backend.forward(q, k, v, spec, batch, save_kv_cache)
        return out.reshape(tokens, spec.num_q_heads * spec.head_dim)

    def attend_stored(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention for q [T, Hq, D] whose step K/V a fused kernel already wrote to the pool (at the slots the
        backend's `step_kv_slots` gave): the backend reads them from there, so k/v are shape-only placeholders."""
        spec = self.spec
        kv = q.new_empty((q.shape[0], spec.num_kv_heads, spec.head_dim))
        return self(q, kv, kv, batch, save_kv_cache=False)

    def extra_repr(self) -> str:
        s = self.spec
        window = f", sliding_window={s.sliding_window}" if s.sliding_window else ""
        return f"layer_id={s.layer_id}, heads={s.num_q_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}{window}"
