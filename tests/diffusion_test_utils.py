"""Tiny random diffusers pipelines built locally (nothing from a hub) for the diffusion tests."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a", "an", "the", "red", "green", "blue", "yellow", "circle", "square", "triangle", "moving", "left",
         "right", "up", "down", "on", "black")


def make_tiny_wan(root: Path, *, seed: int = 0, head_dim: int = 16, heads: int = 2, layers: int = 2,
                  patch: tuple[int, int, int] = (1, 2, 2)) -> Path:
    """A random Wan text-to-video pipeline (UMT5 + WanTransformer3DModel + AutoencoderKLWan) in diffusers layout."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from sglx.diffusion.word_tokenizer import build_word_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(WORDS)
    text_dim = 32
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=text_dim, d_kv=8, d_ff=64,
                                               num_layers=1, num_heads=4, relative_attention_num_buckets=8,
                                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True], scale_factor_temporal=2, scale_factor_spatial=4,
                           latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.5, 0.8, 1.0, 1.2])
    transformer = WanTransformer3DModel(patch_size=patch, num_attention_heads=heads, attention_head_dim=head_dim,
                                        in_channels=4, out_channels=4, text_dim=text_dim, freq_dim=16,
                                        ffn_dim=64, num_layers=layers, rope_max_seq_len=64)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)
    pipe.save_pretrained(str(root))
    return root
