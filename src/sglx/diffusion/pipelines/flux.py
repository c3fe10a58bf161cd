"""FLUX.1 text-to-image: CLIP (pooled) + T5 text encoders, FluxTransformer2DModel, AutoencoderKL.

The loop mirrors diffusers' FluxPipeline (same noise, packed 2x2 latents, dynamic shift, guidance,
VAE scaling and shift), so outputs match it, with every joint text+image attention going through sglx's
DiT attention layer and the selected backend.

Guidance flags, as diffusers names them:
- `--guidance-scale` is FLUX's *distilled* guidance (diffusers' `guidance_scale`): on models with
  `guidance_embeds` (FLUX.1-dev) it enters the timestep embedding and costs nothing; models without it
  (FLUX.1-schnell) ignore it. It never runs a second branch.
- `--true-cfg-scale` with `--negative-prompt` is real classifier-free guidance (diffusers'
  `true_cfg_scale`): both branches run, here as one batch. It runs only when both are given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.metadata import DiTAttnMetadata, dit_step
from sglx.diffusion.loader import ModelIndex, load_component
from sglx.diffusion.pipelines.base import NativePipeline, ProgressFn, StageClock, check_multiple, latent_noise
from sglx.diffusion.processors import flux as flux_processors
from sglx.diffusion.request import DiffusionDefaults, ResolvedRequest
from sglx.errors import SglxError

FLUX_DEV_DEFAULTS = DiffusionDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=28,
                                      guidance_scale=3.5, max_sequence_length=512)
# FLUX.1-schnell (no guidance embedding): timestep-distilled to 4 steps, 256 T5 tokens as its model card runs it.
FLUX_SCHNELL_DEFAULTS = DiffusionDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=4,
                                          guidance_scale=0.0, max_sequence_length=256)
MAX_T5_TOKENS = 512


def calculate_shift(image_seq_len: int, config: Any) -> float:
    """The resolution-dependent shift `mu`: linear in the image token count, as diffusers' FluxPipeline."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + base_shift - slope * base_len


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4]: each 2x2 latent patch becomes one token."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent of h x w (both even)."""
    b, _, channels = latents.shape
    patches = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, h, w)


def latent_image_ids(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[h*w, 3] rotary positions (0, row, col) of the packed image tokens, row-major."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


class FluxPipeline(NativePipeline):
    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    default_values = FLUX_DEV_DEFAULTS

    def __init__(self, index: ModelIndex, device: torch.device, dtype: torch.dtype,
                 backend: DiffusionAttentionBackend, components: dict[str, Any], defaults: DiffusionDefaults) -> None:
        super().__init__(index, device, dtype, backend)
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"]
        self.tokenizer_2 = components["tokenizer_2"]
        self.text_encoder_2 = components["text_encoder_2"]
        self.transformer = components["transformer"]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        self.defaults = defaults
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.clip_max_length = int(getattr(self.tokenizer, "model_max_length", 77) or 77)
        if self.clip_max_length > 1_000_000:  # tokenizers saved without a limit report a huge sentinel
            self.clip_max_length = 77
        self.num_layers = len(self.transformer.transformer_blocks) + len(self.transformer.single_transformer_blocks)

    @classmethod
    def load(cls, index: ModelIndex, device: torch.device, dtype: torch.dtype,
             backend: DiffusionAttentionBackend, defaults: DiffusionDefaults | None) -> FluxPipeline:
        comps: dict[str, Any] = {
            "tokenizer": load_component(index, "tokenizer"),
            "text_encoder": load_component(index, "text_encoder", torch_dtype=dtype),
            "tokenizer_2": load_component(index, "tokenizer_2"),
            "text_encoder_2": load_component(index, "text_encoder_2", torch_dtype=dtype),
            "transformer": load_component(index, "transformer", torch_dtype=dtype),
            "vae": load_component(index, "vae", torch_dtype=dtype),
            "scheduler": load_component(index, "scheduler"),
        }
        for name in ("text_encoder", "text_encoder_2", "transformer", "vae"):
            comps[name] = comps[name].to(device).eval().requires_grad_(False)
        flux_processors.install(comps["transformer"], backend)
        if defaults is None or defaults is FLUX_DEV_DEFAULTS:
            defaults = FLUX_DEV_DEFAULTS if comps["transformer"].config.guidance_embeds else FLUX_SCHNELL_DEFAULTS
        return cls(index, device, dtype, backend, comps, defaults)

    @property
    def attention_shape(self) -> tuple[int, int]:
        cfg = self.transformer.config
        return int(cfg.num_attention_heads), int(cfg.attention_head_dim)

    def validate(self, req: ResolvedRequest) -> None:
        if req.num_frames != 1:
            raise SglxError(f"--num-frames {req.num_frames}: FLUX makes images; use --num-frames 1 or a .png output")
        step = self.vae_scale * 2
        why = f"the VAE downsamples by {self.vae_scale} and FLUX packs 2x2 latent patches"
        check_multiple("height", req.height, step, why)
        check_multiple("width", req.width, step, why)
        if req.num_inference_steps < 1:
            raise SglxError(f"--num-inference-steps {req.num_inference_steps}: must be at least 1")
        if not 1 <= req.max_sequence_length <= MAX_T5_TOKENS:
            raise SglxError(f"max_sequence_length {req.max_sequence_length}: FLUX's T5 takes 1..{MAX_T5_TOKENS} "
                            "tokens; set it in the model's sglx.json defaults")
        if req.true_cfg_scale > 1.0 and not req.negative_prompt:
            raise SglxError(f"--true-cfg-scale {req.true_cfg_scale:g} needs --negative-prompt (true CFG steers "
                            "away from it); give one, or drop --true-cfg-scale and use --guidance-scale")
        if req.negative_prompt and req.true_cfg_scale <= 1.0:
            raise SglxError("--negative-prompt does nothing for FLUX unless --true-cfg-scale is above 1 (FLUX's "
                            "--guidance-scale is distilled guidance, with no negative branch); add --true-cfg-scale "
                            "4, or drop --negative-prompt")

    # ------------------------------------------------------------------------------------------ stages

    @torch.no_grad()
    def encode_text(self, prompts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 token embeddings [B, max_len, D], pooled CLIP embedding [B, P]) as diffusers' encode_prompt."""
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.clip_max_length, truncation=True,
                                  return_tensors="pt").input_ids.to(self.device)
        pooled = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=max_len, truncation=True,
                                  return_tensors="pt").input_ids.to(self.device)
        embeds = self.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        return embeds.to(self.dtype), pooled.to(self.dtype)

    def metadata(self, latent_h: int, latent_w: int, text_tokens: int, batch: int, cfg: bool,
                 steps: int) -> DiTAttnMetadata:
        heads, dim = self.attention_shape
        return DiTAttnMetadata(grid=(1, latent_h // 2, latent_w // 2), num_heads=heads, head_dim=dim,
                               text_tokens=text_tokens, text_position="prefix", num_steps=steps, batch_size=batch,
                               cfg=cfg, num_layers=self.num_layers)

    def timesteps(self, steps: int, image_tokens: int) -> Any:
        """A fresh scheduler set to diffusers' FLUX schedule (sigmas 1 -> 1/steps, shifted by `mu`)."""
        scheduler = self.scheduler.__class__.from_config(self.scheduler.config)
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(steps if sigmas is None else None, device=self.device, sigmas=sigmas,
                                mu=calculate_shift(image_tokens, scheduler.config))
        scheduler.set_begin_index(0)
        return scheduler

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, latent_hw: tuple[int, int], cond: tuple[torch.Tensor, torch.Tensor],
                uncond: tuple[torch.Tensor, torch.Tensor] | None, guidance: float, true_cfg: float, steps: int,
                progress: ProgressFn | None = None) -> torch.Tensor:
        """The flow-matching loop over packed latents; with true CFG both branches run as one batch of 2B rows."""
        h, w = latent_hw
        scheduler = self.timesteps(steps, latents.shape[1])
        embeds, pooled = cond if uncond is None else (torch.cat([cond[0], uncond[0]]), torch.cat([cond[1], uncond[1]]))
        rows = embeds.shape[0]
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        img_ids = latent_image_ids(h // 2, w // 2, self.device, self.dtype)
        guidance_t = torch.full([rows], guidance, device=self.device, dtype=torch.float32) if self.guidance_embeds \
            else None
        meta = self.metadata(h, w, embeds.shape[1], rows, uncond is not None, len(scheduler.timesteps))
        for i, t in enumerate(scheduler.timesteps):
            x = latents.to(self.dtype)
            x = x if uncond is None else torch.cat([x, x])
            with dit_step(meta.at_step(i, float(t))):
                pred = self.transformer(hidden_states=x, timestep=t.expand(rows).to(self.dtype) / 1000,
                                        guidance=guidance_t, pooled_projections=pooled, encoder_hidden_states=embeds,
                                        txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0]
            if uncond is not None:
                pred_cond, pred_uncond = pred.chunk(2)
                pred = pred_uncond + true_cfg * (pred_cond - pred_uncond)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
            if progress is not None:
                progress(i + 1, steps)
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """Packed latents -> [1, H, W, 3] floats in [0, 1] (first batch row), on the CPU."""
        cfg = self.vae.config
        latents = unpack_latents(latents, *latent_hw).to(self.vae.dtype)
        latents = latents / cfg.scaling_factor + cfg.shift_factor
        image = self.vae.decode(latents, return_dict=False)[0]
        image = (image[0].float() / 2 + 0.5).clamp(0, 1)  # [C, H, W]
        return image.permute(1, 2, 0).unsqueeze(0).contiguous().cpu()

    def generate_tensor(self, req: ResolvedRequest, progress: ProgressFn | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
        clock = StageClock(self.device)
        clock.start()
        true_cfg = req.true_cfg_scale > 1.0 and bool(req.negative_prompt)
        cond = self.encode_text([req.prompt], req.max_sequence_length)
        uncond = self.encode_text([req.negative_prompt], req.max_sequence_length) if true_cfg else None
        clock.stop("text_encode")
        latent_hw = (req.height // self.vae_scale, req.width // self.vae_scale)
        channels = int(self.transformer.config.in_channels) // 4
        # diffusers draws the unpacked [B, C, h, w] noise in the model dtype (a float32 draw rounded to it is the
        # same numbers), then packs it: draw the same shape, so one seed gives diffusers' picture.
        latents = pack_latents(latent_noise((1, channels, *latent_hw), req.seed, self.device)).to(self.dtype)
        latents = self.denoise(latents, latent_hw, cond, uncond, req.guidance_scale, req.true_cfg_scale,
                               req.num_inference_steps, progress)
        clock.stop("denoise")
        frames = self.decode(latents, latent_hw)
        clock.stop("vae_decode")
        return frames, clock.times
