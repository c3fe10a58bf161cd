"""The FastAPI app: routes, middleware (API key, body limit, request counting) and JSON error handlers.

`create_app(engine, config)` takes a running sglx.Engine; the engine's scheduler thread does the
work, the HTTP event loop only validates, submits and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sglx.errors import SglxError
from sglx.llm.engine import Engine
from sglx.server import info_api, native_api, openai_api
from sglx.server.config import ServerConfig
from sglx.server.errors import APIError, error_response
from sglx.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    QuietShutdownMiddleware,
    RequestCountMiddleware,
)
from sglx.server.state import ServerState

log = logging.getLogger("sglx.server")

ROUTES = (
    ("GET", "/health", info_api.health),
    ("GET", "/v1/models", info_api.models),
    ("GET", "/server_info", info_api.server_info),
    ("GET", "/metrics", info_api.metrics),
    ("POST", "/flush_cache", info_api.flush_cache),
    ("POST", "/v1/completions", openai_api.completions),
    ("POST", "/v1/chat/completions", openai_api.chat_completions),
    ("POST", "/generate", native_api.generate),
)


def create_app(engine: Engine, config: ServerConfig | None = None, shutdown_engine: bool = False) -> FastAPI:
    """The app over a running engine; with shutdown_engine, the app's shutdown also stops the engine.

    Stopping it there (uvicorn's lifespan shutdown, after in-flight requests finished or were cancelled)
    keeps the event loop open while the scheduler hands back the last chunks of aborted requests.
    """
    config = config or ServerConfig()
    state = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.stopping = True
        if shutdown_engine:
            await asyncio.sleep(0.05)  # let cancelled requests unwind and queue their aborts first
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="sglx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.sglx = state
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        headers = {"Connection": "close"} if exc.status == 413 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

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

    paths = {path for _, path, _ in ROUTES}
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestCountMiddleware, metrics=state.metrics, routes=lambda: paths)
    app.add_middleware(QuietShutdownMiddleware, stopping=lambda: state.stopping)
    return app
