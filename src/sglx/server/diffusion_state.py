"""What every route of a diffusion server shares: the engine, its job queue, the video jobs and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglx.server.config import ServerConfig
from sglx.server.diffusion_metrics import DiffusionMetrics
from sglx.server.diffusion_queue import GenerationQueue
from sglx.server.state import check_model
from sglx.server.video_jobs import VideoStore


@dataclass
class DiffusionServerState:
    engine: Any  # DiffusionEngine (or a test double with .generate/.resolve/.defaults/.info)
    config: ServerConfig
    queue: GenerationQueue
    metrics: DiffusionMetrics = field(default_factory=DiffusionMetrics)
    videos: VideoStore = field(default_factory=VideoStore)
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or Path(str(self.engine.info["model_path"])).name

    def check_model(self, model: str | None) -> None:
        check_model(model, self.model_name)
