"""Wan2.1 / Wan2.2 text-to-video: UMT5 text encoder, WanTransformer3DModel, AutoencoderKLWan.

The denoising loop mirrors diffusers' WanPipeline (same noise, timesteps, guidance and VAE
normalisation, so outputs match it) with two differences that make it faster: both CFG branches run
as one batch, and every attention goes through sglx's DiT attention layer and the selected backend.
"""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.metadata import DiTAttnMetadata, dit_step
from sglx.diffusion.loader import ModelIndex, load_component
from sglx.diffusion.pipelines.base import NativePipeline, ProgressFn, StageClock, check_multiple, latent_noise
from sglx.diffusion.processors import wan as wan_processors
from sglx.diffusion.request import DiffusionDefaults, ResolvedRequest
from sglx.errors import SglxError

WAN_DEFAULTS = DiffusionDefaults(height=480, width=832, num_frames=81, num_inference_steps=50,
                                 guidance_scale=5.0, fps=16, max_sequence_length=512)


class WanPipeline(NativePipeline):
    family = "wan"
    pipeline_classes = ("WanPipeline",)
    default_values = WAN_DEFAULTS

    def __init__(self, index: ModelIndex, device: torch.device, dtype: torch.dtype,
                 backend: DiffusionAttentionBackend, components: dict[str, Any], defaults: DiffusionDefaults) -> None:
        super().__init__(index, device, dtype, backend)
        self.tokenizer = components["tokenizer"]
        self.text_encoder = components["text_encoder"]
        self.transformer = components["transformer"]
        self.transformer_2 = components.get("transformer_2")
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        self.defaults = defaults
        self.boundary_ratio = index.extra.get("boundary_ratio")
        self.expand_timesteps = bool(index.extra.get("expand_timesteps", False))
        self.scale_t = int(self.vae.config.scale_factor_temporal)
        self.scale_s = int(self.vae.config.scale_factor_spatial)
        self.patch = tuple(int(p) for p in self.transformer.config.patch_size)

    @classmethod
    def load(cls, index: ModelIndex, device: torch.device, dtype: torch.dtype,
             backend: DiffusionAttentionBackend, defaults: DiffusionDefaults | None) -> WanPipeline:
        comps: dict[str, Any] = {
            "tokenizer": load_component(index, "tokenizer"),
            "text_encoder": load_component(index, "text_encoder", torch_dtype=dtype),
            "transformer": load_component(index, "transformer", torch_dtype=dtype),
            # Wan's VAE runs in float32, as diffusers' examples load it: bf16 decoding visibly bands.
            "vae": load_component(index, "vae", torch_dtype=torch.float32),
            "scheduler": load_component(index, "scheduler"),
        }
        if "transformer_2" in index.components:
            comps["transformer_2"] = load_component(index, "transformer_2", torch_dtype=dtype)
        for name in ("text_encoder", "transformer", "transformer_2", "vae"):
            if name in comps:
                comps[name] = comps[name].to(device).eval().requires_grad_(False)
        for name in ("transformer", "transformer_2"):
            if name in comps:
                wan_processors.install(comps[name], backend)
        return cls(index, device, dtype, backend, comps, defaults or WAN_DEFAULTS)

    @property
    def attention_shape(self) -> tuple[int, int]:
        cfg = self.transformer.config
        return int(cfg.num_attention_heads), int(cfg.attention_head_dim)

    def validate(self, req: ResolvedRequest) -> None:
        check_multiple("height", req.height, self.scale_s * self.patch[1],
                       f"the VAE downsamples by {self.scale_s} and the DiT patch is {self.patch[1]}")
        check_multiple("width", req.width, self.scale_s * self.patch[2],
                       f"the VAE downsamples by {self.scale_s} and the DiT patch is {self.patch[2]}")
        if req.num_frames < 1 or (req.num_frames - 1) % self.scale_t:
            k, s = max(0, (req.num_frames - 1) // self.scale_t), self.scale_t
            raise SglxError(f"--num-frames {req.num_frames}: Wan takes {s}k+1 frames (1, {s + 1}, {2 * s + 1}, "
                            f"...); try --num-frames {k * s + 1}")
        if req.num_inference_steps < 1:
            raise SglxError(f"--num-inference-steps {req.num_inference_steps}: must be at least 1")

    # ------------------------------------------------------------------------------------------ stages

    @torch.no_grad()
    def encode_text(self, prompts: list[str], max_len: int) -> torch.Tensor:
        """UMT5 embeddings padded with zeros past each prompt's length, as diffusers' WanPipeline builds them."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_len,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        embeds = self.text_encoder(ids, mask).last_hidden_state
        keep = mask.gt(0).unsqueeze(-1)
        return torch.where(keep, embeds, torch.zeros_like(embeds)).to(self.dtype)

    def _model_for(self, t: torch.Tensor, guidance: float) -> tuple[Any, float]:
        if self.boundary_ratio is None or self.transformer_2 is None:
            return self.transformer, guidance
        boundary = self.boundary_ratio * self.scheduler.config.num_train_timesteps
        return (self.transformer, guidance) if t >= boundary else (self.transformer_2, guidance)

    def metadata(self, latents: torch.Tensor, batch: int, cfg: bool, steps: int) -> DiTAttnMetadata:
        _, _, f, h, w = latents.shape
        heads, dim = self.attention_shape
        grid = (f // self.patch[0], h // self.patch[1], w // self.patch[2])
        return DiTAttnMetadata(grid=grid, num_heads=heads, head_dim=dim, num_steps=steps, batch_size=batch,
                               cfg=cfg, num_layers=len(self.transformer.blocks))

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
                steps: int, progress: ProgressFn | None = None) -> torch.Tensor:
        """The flow-matching loop; with guidance both branches run as one batch of 2B rows."""
        scheduler = self.scheduler.__class__.from_config(self.scheduler.config)
        scheduler.set_timesteps(steps, device=self.device)
        scheduler.set_begin_index(0)
        context = cond if uncond is None else torch.cat([cond, uncond])
        rows = context.shape[0]
        meta = self.metadata(latents, rows, uncond is not None, len(scheduler.timesteps))
        for i, t in enumerate(scheduler.timesteps):
            model, scale = self._model_for(t, guidance)
            x = latents.to(self.dtype)
            x = x if uncond is None else torch.cat([x, x])
            if self.expand_timesteps:
                _, _, f, h, w = latents.shape
                per_token = t.expand(f * (h // self.patch[1]) * (w // self.patch[2]))
                timestep = per_token.unsqueeze(0).expand(rows, -1)
            else:
                timestep = t.expand(rows)
            with dit_step(meta.at_step(i, float(t))):
                pred = model(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
            if uncond is not None:
                pred_cond, pred_uncond = pred.chunk(2)
                pred = pred_uncond + scale * (pred_cond - pred_uncond)
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
            if progress is not None:
                progress(i + 1, steps)
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> [F, H, W, 3] floats in [0, 1] (first batch row), on the CPU."""
        cfg = self.vae.config
        latents = latents.to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]
        video = (video[0].float() / 2 + 0.5).clamp(0, 1)  # [C, F, H, W]
        return video.permute(1, 2, 3, 0).contiguous().cpu()

    def generate_tensor(self, req: ResolvedRequest, progress: ProgressFn | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
        clock = StageClock(self.device)
        clock.start()
        cond = self.encode_text([req.prompt], req.max_sequence_length)
        uncond = self.encode_text([req.negative_prompt], req.max_sequence_length) if req.cfg else None
        clock.stop("text_encode")
        shape = (1, int(self.transformer.config.in_channels), (req.num_frames - 1) // self.scale_t + 1,
                 req.height // self.scale_s, req.width // self.scale_s)
        latents = latent_noise(shape, req.seed, self.device)
        latents = self.denoise(latents, cond, uncond, req.guidance_scale, req.num_inference_steps, progress)
        clock.stop("denoise")
        frames = self.decode(latents)
        clock.stop("vae_decode")
        return frames, clock.times
