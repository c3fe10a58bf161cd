"""Server-side options of `sglx serve` (the engine's are EngineConfig's), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from sglx.errors import SglxError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 64


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: an open port serves anyone on the network
    port: int = 30000
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # None: the model directory's name
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before they are parsed
    log_level: str = "info"
    grace_period: float = 10.0  # seconds in-flight requests get to finish after SIGINT/SIGTERM
    # diffusion servers: generation jobs (images and videos) that may wait behind the running one; more is a 503
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"--port {self.port}: must be in 0..65535")
        if self.max_request_bytes < 1024:
            problems.append(f"--max-request-bytes {self.max_request_bytes}: must be at least 1024")
        if self.log_level not in LOG_LEVELS:
            problems.append(f"--log-level {self.log_level}: choose one of {', '.join(LOG_LEVELS)}")
        if self.grace_period < 0:
            problems.append(f"--grace-period {self.grace_period}: must be >= 0 seconds")
        if self.max_queued_requests < 0:
            problems.append(f"--max-queued-requests {self.max_queued_requests}: must be >= 0")
        if self.api_key is not None and not self.api_key.strip():
            problems.append("--api-key is empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            problems.append("--served-model-name is empty")
        if problems:
            raise SglxError("invalid server options:\n" + "\n".join(f"  - {p}" for p in problems))
