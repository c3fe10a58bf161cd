"""Request schemas of the diffusion API: OpenAI's image and video fields plus SGLang diffusion's extensions.

Strict like the LLM schemas (a parameter sglx does not implement is a 400 naming it); form bodies are
validated in lax mode by the caller, since every form value is a string.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from sglx.server.protocol import Strict

MAX_IMAGES = 10  # OpenAI's n limit for images; each is a full generation
SEED_MAX = 2**63 - 1 - MAX_IMAGES  # seeds seed..seed+n-1 must all be valid torch seeds
SIZE_RE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SIDE = 4096  # pixels: a typo such as 99992x99992 must not take the server's memory
MAX_FRAMES = 1025  # about a minute at 16 fps; Wan takes 4k+1


def parse_size(size: str | None) -> tuple[int, int] | None:
    """OpenAI's "WIDTHxHEIGHT" -> (width, height); None or "auto" -> None (the model's default)."""
    if size is None or size == "auto":
        return None
    match = SIZE_RE.match(size.strip().lower())
    if match is None:
        raise ValueError("must be WIDTHxHEIGHT in pixels, e.g. 832x480, or auto")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise ValueError("width and height must be positive")
    if width > MAX_SIDE or height > MAX_SIDE:
        raise ValueError(f"width and height must be at most {MAX_SIDE} pixels")
    return width, height


class DiffusionFields(Strict):
    """The knobs images and videos share; null = the model's default."""

    model: str | None = None
    prompt: str = Field(min_length=1, max_length=100_000)
    size: str | None = None
    negative_prompt: str | None = Field(None, max_length=100_000)  # extension (SGLang diffusion)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)  # extension
    guidance_scale: float | None = Field(None, ge=0, le=100)  # extension
    seed: int | None = Field(None, ge=0, le=SEED_MAX)  # extension

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        parse_size(value)
        return value

    @property
    def width_height(self) -> tuple[int, int] | None:
        return parse_size(self.size)


class ImageGenerationRequest(DiffusionFields):
    """POST /v1/images/generations."""

    n: int | None = Field(None, ge=1, le=MAX_IMAGES)
    response_format: str | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    user: str | None = None  # accepted as OpenAI does; unused

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: str | None) -> str | None:
        if value == "url":
            raise ValueError("'url' is not supported: sglx does not host image files; use "
                             "response_format='b64_json' (the default)")
        if value not in (None, "b64_json"):
            raise ValueError("must be 'b64_json'")
        return value


class VideoCreateRequest(DiffusionFields):
    """POST /v1/videos (JSON, or multipart form as OpenAI's client sends it)."""

    seconds: str | int | float | None = None
    num_frames: int | None = Field(None, ge=1, le=MAX_FRAMES)  # extension: wins over seconds
    fps: int | None = Field(None, ge=1, le=240)  # extension
    input_reference: Any = None

    @field_validator("seconds", mode="plain")
    @classmethod
    def _seconds(cls, value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool):
            raise ValueError("must be a number of seconds")
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ValueError("must be a number of seconds, e.g. \"4\"") from None
        if not 0 < seconds <= 3600:
            raise ValueError("must be more than 0 and at most 3600 seconds")
        return seconds

    @field_validator("input_reference", mode="plain")
    @classmethod
    def _no_reference(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("image-to-video is not supported: this server makes videos from text only; "
                             "remove input_reference")
        return None
