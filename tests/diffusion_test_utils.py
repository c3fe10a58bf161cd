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


def build_tiny_clip_tokenizer(words: list[str] = WORDS, max_length: int = 77):  # type: ignore[no-untyped-def]
    """A CLIPTokenizer over a hand-made BPE vocabulary: letters plus a merge chain per word (one token each)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz.,!?":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        merged = pieces[0]
        for piece in pieces[1:]:
            if (merged, piece) not in merges:
                merges.append((merged, piece))
            merged += piece
            vocab.setdefault(merged, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def make_tiny_flux(root: Path, *, seed: int = 0, guidance_embeds: bool = True, head_dim: int = 16, heads: int = 2,
                   layers: int = 1, single_layers: int = 2) -> Path:
    """A random FLUX.1 pipeline (CLIP + T5 + FluxTransformer2DModel + AutoencoderKL) in diffusers layout.

    `guidance_embeds=True` is FLUX.1-dev-like (distilled guidance enters the timestep embedding), False is
    schnell-like. The VAE has four levels, so it downsamples by 8 like FLUX's and sizes step by 16.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from sglx.diffusion.word_tokenizer import build_word_tokenizer

    torch.manual_seed(seed)
    clip_tokenizer = build_tiny_clip_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tokenizer), hidden_size=32, intermediate_size=37,
                                        num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=77,
                                        projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    t5_tokenizer = build_word_tokenizer(WORDS)
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                 num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=layers,
                                         num_single_layers=single_layers, attention_head_dim=head_dim,
                                         num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32,
                                         guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=guidance_embeds,
                                                base_image_seq_len=4, max_image_seq_len=64)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                        tokenizer_2=t5_tokenizer, transformer=transformer)
    pipe.save_pretrained(str(root))
    return root


def step_order_models(backend):  # type: ignore[no-untyped-def]
    """(kept, per_layer, dense, inputs) for step-order tests: three copies of one random 3-layer Wan transformer
    (latent grid 3x4x16), `backend` installed on `kept` (its step order hooks included), the same backend behind a
    wrapper without `step_order` on `per_layer` (it reorders in every layer), `dense` untouched."""
    import copy

    from diffusers import WanTransformer3DModel

    from sglx.attention.diffusion.base import DiffusionAttentionBackend
    from sglx.diffusion.processors.wan import install

    class PerLayer(DiffusionAttentionBackend):
        def __init__(self, inner):  # type: ignore[no-untyped-def]
            super().__init__({})
            self.inner = inner

        def forward_dense(self, q, k, v, *, scale=None):  # type: ignore[no-untyped-def]
            return self.inner.forward_dense(q, k, v, scale=scale)

        def forward(self, q, k, v, *, scale=None, meta=None, layer=0):  # type: ignore[no-untyped-def]
            return self.inner.forward(q, k, v, scale=scale, meta=meta, layer=layer)

    torch.manual_seed(0)
    dense = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=16, ffn_dim=64, num_layers=3,
                                  rope_max_seq_len=64).eval()
    kept, per_layer = copy.deepcopy(dense), copy.deepcopy(dense)
    install(kept, backend)
    install(per_layer, PerLayer(backend))
    inputs = {"hidden_states": torch.randn(1, 4, 3, 8, 32), "timestep": torch.tensor([500.0]),
              "encoder_hidden_states": torch.randn(1, 8, 32), "return_dict": False}
    return kept, per_layer, dense, inputs
