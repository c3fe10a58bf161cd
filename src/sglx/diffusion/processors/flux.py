"""sglx's processor for diffusers' FluxAttention: projections, QK norms and rotary as diffusers, attention as sglx.

FLUX has two kinds of block. The double-stream `transformer_blocks` project text and image separately and
attend jointly over [text tokens, image tokens]; the single-stream `single_transformer_blocks` already
carry that concatenated sequence. Either way the attention is one self-attention with the text as a
prefix, so both go through `DiTAttention.self_attention` (text_position "prefix" in the step metadata).
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.diffusion.dit_attention import DiTAttention, apply_interleaved_rotary


class FluxAttnProcessor:
    """Replaces diffusers' FluxAttnProcessor on one FluxAttention (double- or single-stream block)."""

    def __init__(self, attention: DiTAttention) -> None:
        self.attention = attention

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        if attention_mask is not None:
            raise NotImplementedError("sglx's FLUX attention takes no attention mask (FLUX attends to padded text)")
        query, key, value, enc_query, enc_key, enc_value = _get_qkv_projections(attn, hidden_states,
                                                                               encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:  # double-stream: text tokens first, then image tokens
            enc_query = attn.norm_added_q(enc_query.unflatten(-1, (-1, attn.head_dim)))
            enc_key = attn.norm_added_k(enc_key.unflatten(-1, (-1, attn.head_dim)))
            enc_value = enc_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([enc_query, query], dim=1)
            key = torch.cat([enc_key, key], dim=1)
            value = torch.cat([enc_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_flux_rotary(query, *image_rotary_emb)
            key = apply_flux_rotary(key, *image_rotary_emb)
        out = self.attention.self_attention(query, key, value).flatten(2, 3).to(query.dtype)
        if not joint:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out[:, :text_len], out[:, text_len:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def apply_flux_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FLUX's rotary on interleaved pairs; cos/sin [S, D] with each frequency repeated for the pair, x [B, S, H, D].

    diffusers' apply_rotary_emb (use_real, unbind -1) computes x*cos + rot(x)*sin in float32; with the
    pairwise-repeated tables that is the interleaved rotation Wan uses, so one helper serves both.
    """
    cos = cos.to(x.device)[None, :, None, :]
    sin = sin.to(x.device)[None, :, None, :]
    return apply_interleaved_rotary(x.float(), cos, sin).to(x.dtype)


def install(transformer: Any, backend: DiffusionAttentionBackend) -> int:
    """Put sglx's processor on every attention of a FluxTransformer2DModel; returns the number of layers.

    Layer indices count the double-stream blocks first, then the single-stream blocks, in forward order.
    """
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    for index, block in enumerate(blocks):
        block.attn.set_processor(FluxAttnProcessor(DiTAttention(backend, index)))
    return len(blocks)
