"""HTTP requests -> DiffusionRequest: sizes, seconds -> frames, and the engine's validation as 400s.

Video length: `num_frames` wins when given; else `seconds * fps` (fps: the request's, else the model's)
rounded to the nearest frame count the model takes (Wan: 4k+1, so 4 s at 16 fps = 64 -> 65 frames; ties
go to the longer clip); with neither, the model's default frame count.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sglx.diffusion.request import DiffusionRequest, ResolvedRequest
from sglx.errors import SglxError
from sglx.server.diffusion_protocol import MAX_FRAMES, DiffusionFields, VideoCreateRequest
from sglx.server.errors import APIError

# CLI flag names in the engine's messages -> the API's parameter names.
API_NAMES = (("--num-inference-steps", "num_inference_steps"), ("--num-frames", "num_frames"),
             ("--height", "height"), ("--width", "width"), ("--guidance-scale", "guidance_scale"))
MAX_FRAME_SEARCH = 64


def base_request(body: DiffusionFields, num_frames: int | None = None, fps: int | None = None) -> DiffusionRequest:
    size = body.width_height
    return DiffusionRequest(prompt=body.prompt, negative_prompt=body.negative_prompt,
                            height=size[1] if size else None, width=size[0] if size else None,
                            num_frames=num_frames, num_inference_steps=body.num_inference_steps,
                            guidance_scale=body.guidance_scale, fps=fps, seed=body.seed)


def resolve(engine: Any, request: DiffusionRequest, size: str | None = None) -> ResolvedRequest:
    """engine.resolve, its SglxError turned into a 400 that names the API parameter."""
    try:
        return engine.resolve(request)
    except SglxError as exc:
        message, param = str(exc), None
        for flag, name in API_NAMES:
            if flag in message:
                param = param or name
                message = message.replace(flag, name)
        if param in ("height", "width"):
            message, param = (f"size {size}: {message}" if size else message), "size"
        raise APIError(400, message, param, "invalid_value") from None


def _takes(engine: Any, request: DiffusionRequest) -> bool:
    try:
        engine.resolve(request)
    except SglxError:
        return False
    return True


def video_request(engine: Any, body: VideoCreateRequest) -> DiffusionRequest:
    """The video's request with its frame count settled (see the module docstring)."""
    if engine.defaults.num_frames == 1:
        raise APIError(400, "this server runs an image model; use POST /v1/images/generations",
                       "model", "not_a_video_model")
    base = base_request(body, body.num_frames, body.fps)
    resolve(engine, base, body.size)  # size, steps, explicit frames: 400s before any search
    if body.num_frames is not None or body.seconds is None:
        return base
    fps = body.fps or engine.defaults.fps
    target = max(1, round(float(body.seconds) * fps))
    if target > MAX_FRAMES:
        raise APIError(400, f"seconds {body.seconds:g} at {fps} fps is {target} frames; at most {MAX_FRAMES} frames "
                            "per video", "seconds", "invalid_value")
    for delta in range(MAX_FRAME_SEARCH):
        for frames in (target + delta, target - delta):
            if frames >= 1 and _takes(engine, replace(base, num_frames=frames)):
                return replace(base, num_frames=frames)
    raise APIError(400, f"seconds {body.seconds:g} at {fps} fps is {target} frames, and this model takes no frame "
                        "count near it; give num_frames", "seconds", "invalid_value")
