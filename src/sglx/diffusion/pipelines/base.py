"""What every native pipeline offers the engine: load, validate a request, generate."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.diffusion.loader import ModelIndex
from sglx.diffusion.request import DiffusionDefaults, ResolvedRequest
from sglx.errors import SglxError

ProgressFn = Callable[[int, int], None]  # (steps done, total steps)


class StageClock:
    """Wall time per stage, synchronising the device at each boundary so GPU work is counted where it ran."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}
        self._start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self, stage: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self._start
        self._start = now


class NativePipeline(ABC):
    """A diffusers model family that sglx runs itself, with every DiT attention on `backend`."""

    family: ClassVar[str]
    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json `_class_name`s this pipeline runs
    default_values: ClassVar[DiffusionDefaults]
    defaults: DiffusionDefaults

    def __init__(self, index: ModelIndex, device: torch.device, dtype: torch.dtype,
                 backend: DiffusionAttentionBackend) -> None:
        self.index = index
        self.device = device
        self.dtype = dtype
        self.backend = backend

    @classmethod
    @abstractmethod
    def load(cls, index: ModelIndex, device: torch.device, dtype: torch.dtype,
             backend: DiffusionAttentionBackend, defaults: DiffusionDefaults | None) -> NativePipeline:
        """Load the components and install sglx's attention processors."""

    @classmethod
    def family_defaults(cls) -> DiffusionDefaults:
        """Defaults for a model of this family that carries no sglx.json of its own."""
        return cls.default_values

    @property
    @abstractmethod
    def attention_shape(self) -> tuple[int, int]:
        """(heads, head_dim) of the DiT's attention, for backend requirements."""

    @abstractmethod
    def validate(self, req: ResolvedRequest) -> None:
        """Raise SglxError (one line: what and what to do) for a request this model cannot take."""

    @abstractmethod
    def generate_tensor(self, req: ResolvedRequest, progress: ProgressFn | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
        """Frames as float32 [F, H, W, 3] in [0, 1] on the CPU, and seconds per stage."""


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """[F, H, W, 3] floats in [0, 1] -> uint8, rounding as diffusers' numpy_to_pil does."""
    return (frames.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    if value <= 0 or value % multiple:
        lower = max(multiple, value // multiple * multiple)
        raise SglxError(f"--{name} {value} is not a positive multiple of {multiple} ({why}); try --{name} {lower}")


def latent_noise(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Initial noise from a CPU generator, so one seed gives one picture on every device."""
    gen = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device)
