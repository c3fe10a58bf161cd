"""The OpenAI-compatible HTTP server behind `sglx serve`: routes, request schemas, auth, metrics, lifecycle."""

from sglx.server.app import create_app
from sglx.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
