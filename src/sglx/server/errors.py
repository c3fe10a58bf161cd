"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the right HTTP status.

Bad input always ends here as a 4xx naming the offending parameter; only a fault of the server
itself becomes a 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                500: "server_error"}


class APIError(Exception):
    """An error to return as an OpenAI-style JSON body (raised anywhere inside a route)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(message)
        self.headers = dict(headers or {})  # extra response headers, e.g. Retry-After on a 503
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    err = APIError(status, message, param, code)
    return JSONResponse(err.body(), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
