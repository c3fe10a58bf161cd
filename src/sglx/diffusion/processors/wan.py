"""sglx's processor for diffusers' WanAttention: projections as diffusers, prologue and attention as sglx.

Self-attention takes one fused QKV projection (`fuse_qkv`), whose q/k chunks go straight into the fused
RMSNorm + rotary kernel (qk_norm_rope.py) and whose v chunk goes to the backend as a strided view:
no copies or transposes before the kernel. The arithmetic is diffusers' (see test_diffusion_wan.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.diffusion.dit_attention import DiTAttention
from sglx.diffusion.modulation import gate_residual, ln_modulate
from sglx.diffusion.qk_norm_rope import norm_rope
from sglx.diffusion.step_order import install_step_order


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
        query = norm_rope(query, attn.norm_q, attn.heads, rotary_emb)
        key = norm_rope(key, attn.norm_k, attn.heads, rotary_emb)
        value = value.unflatten(2, (attn.heads, -1))
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


def _share(linear: nn.Linear, fused: nn.Linear, start: int) -> None:
    """Point a projection's weight and bias at its rows of the fused projection (no second copy in memory)."""
    rows = linear.out_features
    linear.weight = nn.Parameter(fused.weight[start:start + rows], requires_grad=False)
    linear.bias = nn.Parameter(fused.bias[start:start + rows], requires_grad=False)


@torch.no_grad()
def fuse_qkv(attn: Any) -> None:
    """diffusers' fuse_projections (one GEMM for q, k, v; one for cross k, v), sharing the weights' memory."""
    if getattr(attn, "fused_projections", False) or attn.to_q.bias is None:
        return
    attn.fuse_projections()
    if hasattr(attn, "to_qkv"):
        for i, lin in enumerate((attn.to_q, attn.to_k, attn.to_v)):
            _share(lin, attn.to_qkv, i * lin.out_features)
    if hasattr(attn, "to_kv"):
        for i, lin in enumerate((attn.to_k, attn.to_v)):
            _share(lin, attn.to_kv, i * lin.out_features)


def wan_block_forward(block: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      temb: torch.Tensor, rotary_emb: Any) -> torch.Tensor:
    """diffusers' WanTransformerBlock.forward with its element-wise parts fused (modulation.py).

    Wan2.2 TI2V's per-token modulation (temb [B, S, 6, dim]) keeps diffusers' own forward.
    """
    if temb.ndim == 4:
        return type(block).forward(block, hidden_states, encoder_hidden_states, temb, rotary_emb)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
        block.scale_shift_table + temb.float()).chunk(6, dim=1)
    norm = ln_modulate(hidden_states, block.norm1, scale_msa, shift_msa)
    hidden_states = gate_residual(hidden_states, block.attn1(norm, None, None, rotary_emb), gate_msa)
    norm = ln_modulate(hidden_states, block.norm2)
    hidden_states = hidden_states + block.attn2(norm, encoder_hidden_states, None, None)
    norm = ln_modulate(hidden_states, block.norm3, c_scale_msa, c_shift_msa)
    return gate_residual(hidden_states, block.ffn(norm), c_gate_msa)


def install(transformer: Any, backend: DiffusionAttentionBackend, fuse: bool = True) -> int:
    """Put sglx's processor on every attention of a WanTransformer3DModel; returns the number of blocks.

    With `fuse`: one QKV projection per self-attention and the blocks' element-wise parts fused.
    """
    for index, block in enumerate(transformer.blocks):
        attention = DiTAttention(backend, index)
        for attn in (block.attn1, block.attn2):
            if fuse:
                fuse_qkv(attn)
            attn.set_processor(WanAttnProcessor(attention))
        if fuse and isinstance(block.norm2, nn.LayerNorm | nn.Identity):
            block.forward = types.MethodType(wan_block_forward, block)
    install_step_order(transformer, backend)  # STA, VSA: tokens stay in tile order from the first block to the last
    return len(transformer.blocks)
