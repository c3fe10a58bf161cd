"""sglx's processor for diffusers' WanAttention: projections and norms as diffusers, attention as sglx."""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.diffusion.dit_attention import DiTAttention, apply_interleaved_rotary


class WanAttnProcessor:
    """Replaces diffusers' WanAttnProcessor on one WanAttention (attn1: self, attn2: cross to text)."""

    def __init__(self, attention: DiTAttention) -> None:
        self.attention = attention

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

        if attention_mask is not None:
            raise NotImplementedError("sglx's Wan attention takes no attention mask (Wan pads text with zeros)")
        image_context = None
        if attn.add_k_proj is not None:  # image-to-video: image tokens lead the context, 512 text tokens follow
            split = encoder_hidden_states.shape[1] - 512
            image_context, encoder_hidden_states = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
        cross = encoder_hidden_states is not None
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = apply_interleaved_rotary(query, *rotary_emb)
            key = apply_interleaved_rotary(key, *rotary_emb)
        if cross:
            out = self.attention.cross_attention(query, key, value)
        else:
            out = self.attention.self_attention(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        if image_context is not None:
            key_img, value_img = _get_added_kv_projections(attn, image_context)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            out = out + self.attention.cross_attention(query, key_img, value_img).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def install(transformer: Any, backend: DiffusionAttentionBackend) -> int:
    """Put sglx's processor on every attention of a WanTransformer3DModel; returns the number of blocks."""
    for index, block in enumerate(transformer.blocks):
        attention = DiTAttention(backend, index)
        block.attn1.set_processor(WanAttnProcessor(attention))
        block.attn2.set_processor(WanAttnProcessor(attention))
    return len(transformer.blocks)
