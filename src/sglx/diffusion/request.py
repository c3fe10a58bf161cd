"""What a user asks a diffusion model for, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DiffusionDefaults:
    """A family's (or a model's own `sglx.json`) defaults for every knob a request may leave out."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    fps: int = 16
    max_sequence_length: int = 512
    negative_prompt: str = ""
    true_cfg_scale: float = 1.0  # FLUX-style real CFG beside distilled guidance; 1 = off


@dataclass(frozen=True)
class DiffusionRequest:
    """One prompt's generation; None means the model's default."""

    prompt: str
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    fps: int | None = None
    seed: int | None = None
    true_cfg_scale: float | None = None

    def resolved(self, defaults: DiffusionDefaults, seed: int) -> ResolvedRequest:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return ResolvedRequest(
            prompt=self.prompt,
            negative_prompt=pick(self.negative_prompt, defaults.negative_prompt),
            height=pick(self.height, defaults.height),
            width=pick(self.width, defaults.width),
            num_frames=pick(self.num_frames, defaults.num_frames),
            num_inference_steps=pick(self.num_inference_steps, defaults.num_inference_steps),
            guidance_scale=float(pick(self.guidance_scale, defaults.guidance_scale)),
            fps=pick(self.fps, defaults.fps),
            seed=pick(self.seed, seed),
            max_sequence_length=defaults.max_sequence_length,
            true_cfg_scale=float(pick(self.true_cfg_scale, defaults.true_cfg_scale)),
        )


@dataclass(frozen=True)
class ResolvedRequest:
    """A request with every default filled in; this is what pipelines run."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    fps: int
    seed: int
    max_sequence_length: int = 512
    # Families with distilled guidance (FLUX) read `guidance_scale` as the embedded scale; this is their real
    # classifier-free guidance against `negative_prompt` (diffusers' `true_cfg_scale`), off at 1.
    true_cfg_scale: float = 1.0

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def with_seed(self, seed: int) -> ResolvedRequest:
        return replace(self, seed=seed)


@dataclass(frozen=True)
class StageTimings:
    """Seconds spent in each stage of one generation (device-synchronised at stage boundaries)."""

    text_encode: float
    denoise: float
    vae_decode: float

    @property
    def total(self) -> float:
        return self.text_encode + self.denoise + self.vae_decode

    def to_dict(self) -> dict[str, float]:
        return {"text_encode_s": round(self.text_encode, 4), "denoise_s": round(self.denoise, 4),
                "vae_decode_s": round(self.vae_decode, 4), "total_s": round(self.total, 4)}


@dataclass(frozen=True)
class DiffusionResult:
    """Frames as uint8 [F, H, W, 3] (F = 1 for an image) with the request that made them."""

    frames: np.ndarray
    request: ResolvedRequest
    timings: StageTimings
    attention_backend: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_image(self) -> bool:
        return self.frames.shape[0] == 1
