"""What every sglx HTTP app shares: JSON error handlers and the middleware stack.

The LLM app (app.py) and the diffusion app (diffusion_app.py) both call `install_common`, so API keys,
body limits, request counting, shutdown handling and error bodies behave the same on both.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglx.errors import SglxError
from sglx.server.errors import APIError, error_response
from sglx.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    QuietShutdownMiddleware,
    RequestCountMiddleware,
)

log = logging.getLogger("sglx.server")


def route_labeller(paths: Iterable[str]) -> Callable[[str], str]:
    """path -> its route for metrics: the path itself, the template it matches ({name} = one segment), or other."""
    exact = {p for p in paths if "{" not in p}
    templates = [(re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(p)) + "$"), p)
                 for p in paths if "{" in p]

    def label(path: str) -> str:
        if path in exact:
            return path
        return next((template for pattern, template in templates if pattern.match(path)), "other")

    return label


def install_common(app: FastAPI, state: Any, paths: Iterable[str]) -> None:
    """Error handlers and middleware over `state` (.config, .metrics, .stopping); `paths` (route templates
    too) label the request metrics."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        headers = dict(exc.headers)
        if exc.status == 413:
            headers["Connection"] = "close"
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

    @app.exception_handler(SglxError)
    async def _sglx_error(request: Request, exc: SglxError) -> Response:
        if "shut down" in str(exc):
            return error_response(503, f"the server is shutting down: {exc}", code="engine_stopped")
        return error_response(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"{request.url.path} does not take {request.method}", code="method_not_allowed")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")

    config = state.config
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestCountMiddleware, metrics=state.metrics, label=route_labeller(paths))
    app.add_middleware(QuietShutdownMiddleware, stopping=lambda: state.stopping)
