"""What every route shares: the engine, the server options, the served model name and the metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglx.server.config import ServerConfig
from sglx.server.errors import APIError
from sglx.server.metrics import ServerMetrics
from sglx.server.served_engine import ServedEngine

log = logging.getLogger("sglx.server")


@dataclass
class ServerState:
    engine: ServedEngine
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or Path(self.engine.model_path).name

    def check_model(self, model: str | None) -> None:
        check_model(model, self.model_name)

    def log_stream_error(self, exc: Exception) -> None:
        if isinstance(exc, APIError):
            log.warning("stream ended with an error: %s", exc.message)
        else:
            log.exception("stream failed", exc_info=exc)


def check_model(model: str | None, served: str) -> None:
    """`model` may be omitted; if given it must be the served name (404 otherwise, as OpenAI answers)."""
    if model is not None and model != served:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{served}' (see GET /v1/models)",
                       "model", "model_not_found")


def engine_failure(message: str) -> APIError:
    """The engine could not finish a request (it stopped, or a step failed): a server-side error."""
    if "shut down" in message or "stopped" in message:
        return APIError(503, f"the server is shutting down: {message}", code="engine_stopped")
    return APIError(500, f"the engine failed this request: {message}", code="engine_error")
