"""User-facing errors: each message says what was asked, why it cannot run and what would."""

from __future__ import annotations


class SglxError(Exception):
    """An error caused by the user's input or machine; the CLI prints it without a traceback."""


class BackendUnavailableError(SglxError):
    """An explicitly requested attention backend cannot run here."""


class ConfigError(SglxError):
    """An --attention-backend-config value is malformed or does not match the backend's parameters."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
