"""`--backend diffusers`: run diffusers' own pipeline, for families sglx has no native pipeline for.

`--attention-backend` is handed to diffusers' `set_attention_backend` (its names: flash, _flash_3_hub,
sage, native, ...), as SGLang diffusion does. This is also the same-run peer in sglx's benchmarks.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from sglx.diffusion.diffusers_names import DIFFUSERS_ATTENTION_BACKENDS
from sglx.diffusion.loader import INSTALL_DIFFUSION, ModelIndex, quiet_loading
from sglx.diffusion.pipelines.base import ProgressFn, StageClock, check_multiple
from sglx.diffusion.request import DiffusionDefaults, ResolvedRequest
from sglx.errors import SglxError

GENERIC_DEFAULTS = DiffusionDefaults(height=512, width=512, num_frames=1, num_inference_steps=30,
                                     guidance_scale=5.0)


def _defaults_for(index: ModelIndex, pipe: Any, video: bool) -> DiffusionDefaults:
    """The native pipeline's defaults for families sglx knows, so both backends run the same request."""
    if index.pipeline_class == "WanPipeline":
        from sglx.diffusion.pipelines.wan import WAN_DEFAULTS

        return WAN_DEFAULTS
    if index.pipeline_class == "FluxPipeline":
        from sglx.diffusion.pipelines.flux import FLUX_DEV_DEFAULTS, FLUX_SCHNELL_DEFAULTS

        guided = bool(getattr(pipe.transformer.config, "guidance_embeds", False))
        return FLUX_DEV_DEFAULTS if guided else FLUX_SCHNELL_DEFAULTS
    if video:
        return DiffusionDefaults(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0)
    return GENERIC_DEFAULTS


class _TimedCalls:
    """Sums the wall time of calls to one method (text encoders, VAE decode) inside diffusers' pipeline."""

    def __init__(self, clock: StageClock, owner: Any, method: str, stage: str) -> None:
        self.clock, self.stage = clock, stage
        self.owner, self.method = owner, method
        self.original = getattr(owner, method)

    def __enter__(self) -> _TimedCalls:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.clock.stop("denoise")  # whatever ran before this call belongs to the loop
            out = self.original(*args, **kwargs)
            self.clock.stop(self.stage)
            return out

        setattr(self.owner, self.method, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.method, self.original)


class DiffusersRunner:
    """A loaded diffusers pipeline with the same generate_tensor contract as sglx's native pipelines."""

    family = "diffusers"

    def __init__(self, pipe: Any, index: ModelIndex, device: torch.device, attention: str | None) -> None:
        self.pipe = pipe
        self.index = index
        self.device = device
        self.attention = attention
        params = inspect.signature(pipe.__call__).parameters
        self.video = "num_frames" in params
        self.params = params
        self.defaults = _defaults_for(index, pipe, self.video)

    @classmethod
    def load(cls, index: ModelIndex, device: torch.device, dtype: torch.dtype, attention: str | None
             ) -> DiffusersRunner:
        try:
            import diffusers
        except ImportError as exc:
            raise SglxError(f"--backend diffusers needs the diffusers package ({INSTALL_DIFFUSION})") from exc
        if attention is not None and attention not in DIFFUSERS_ATTENTION_BACKENDS:
            raise SglxError(f"--attention-backend {attention}: with --backend diffusers this is passed to "
                            f"diffusers' set_attention_backend, which takes one of: "
                            f"{', '.join(DIFFUSERS_ATTENTION_BACKENDS)}")
        quiet_loading()
        try:
            pipe = diffusers.DiffusionPipeline.from_pretrained(str(index.path), torch_dtype=dtype,
                                                               local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise SglxError(f"diffusers could not load {index.path} ({index.pipeline_class}): {first}") from exc
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        if attention is not None:
            for name in ("transformer", "transformer_2", "unet"):
                model = getattr(pipe, name, None)
                if model is None:
                    continue
                try:
                    model.set_attention_backend(attention)
                except (ValueError, RuntimeError, ImportError, AttributeError) as exc:
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise SglxError(f"--attention-backend {attention}: diffusers cannot use it here: {first} "
                                    "(--attention-backend native always works)") from exc
        return cls(pipe, index, device, attention)

    @property
    def attention_shape(self) -> tuple[int, int]:
        cfg = getattr(getattr(self.pipe, "transformer", None), "config", None)
        return (int(getattr(cfg, "num_attention_heads", 0) or 0), int(getattr(cfg, "attention_head_dim", 0) or 0))

    def validate(self, req: ResolvedRequest) -> None:
        scale = int(getattr(self.pipe, "vae_scale_factor_spatial", 0) or getattr(self.pipe, "vae_scale_factor", 8))
        check_multiple("height", req.height, scale, f"the VAE downsamples by {scale}")
        check_multiple("width", req.width, scale, f"the VAE downsamples by {scale}")
        if not self.video and req.num_frames != 1:
            raise SglxError(f"{self.index.pipeline_class} makes images; use --num-frames 1 (or a .png output)")
        if req.num_inference_steps < 1:
            raise SglxError(f"--num-inference-steps {req.num_inference_steps}: must be at least 1")

    def generate_tensor(self, req: ResolvedRequest, progress: ProgressFn | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
        kwargs: dict[str, Any] = {
            "prompt": req.prompt, "height": req.height, "width": req.width,
            "num_inference_steps": req.num_inference_steps, "guidance_scale": req.guidance_scale,
            "generator": torch.Generator("cpu").manual_seed(req.seed), "output_type": "pt",
        }
        if "negative_prompt" in self.params and req.negative_prompt:
            kwargs["negative_prompt"] = req.negative_prompt
        if self.video:
            kwargs["num_frames"] = req.num_frames
        if "true_cfg_scale" in self.params:
            kwargs["true_cfg_scale"] = req.true_cfg_scale
        elif req.true_cfg_scale != 1.0:
            raise SglxError(f"--true-cfg-scale: diffusers' {self.index.pipeline_class} has no true CFG; drop it")
        if "max_sequence_length" in self.params:
            kwargs["max_sequence_length"] = req.max_sequence_length
        if progress is not None and "callback_on_step_end" in self.params:
            def on_step(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
                progress(i + 1, req.num_inference_steps)
                return tensors

            kwargs["callback_on_step_end"] = on_step
        clock = StageClock(self.device)
        timers = [_TimedCalls(clock, getattr(self.pipe, n), "forward", "text_encode")
                  for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if getattr(self.pipe, n, None)]
        timers.append(_TimedCalls(clock, self.pipe.vae, "decode", "vae_decode"))
        clock.start()
        for timer in timers:
            timer.__enter__()
        try:
            out = self.pipe(**kwargs)
        finally:
            for timer in timers:
                timer.__exit__()
        clock.stop("vae_decode")  # post-processing after the decode
        images = out.frames[0] if hasattr(out, "frames") else out.images[0]
        images = images.float().cpu()
        if images.dim() == 3:  # one image [C, H, W]
            images = images.unsqueeze(0)
        frames = images.permute(0, 2, 3, 1).contiguous()  # [F, C, H, W] -> [F, H, W, C]
        return frames, clock.times
