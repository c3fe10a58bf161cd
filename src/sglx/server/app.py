"""The FastAPI app: routes, middleware (API key, body limit, request counting) and JSON error handlers.

`create_app(engine, config)` takes a running engine: `sglx serve`'s engine process (EngineClient), or an
sglx.Engine in this process; its scheduler does the work, the HTTP event loop only validates, submits and streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from sglx.llm.engine import Engine
from sglx.server import info_api, native_api, openai_api
from sglx.server.app_base import install_common
from sglx.server.config import ServerConfig
from sglx.server.served_engine import InProcessEngine, ServedEngine
from sglx.server.state import ServerState

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


def create_app(engine: ServedEngine | Engine, config: ServerConfig | None = None,
               shutdown_engine: bool = False) -> FastAPI:
    """The app over a running engine; with shutdown_engine, the app's shutdown also stops the engine.

    Stopping it there (uvicorn's lifespan shutdown, after in-flight requests finished or were cancelled)
    keeps the event loop open while the scheduler hands back the last chunks of aborted requests.
    """
    config = config or ServerConfig()
    served: ServedEngine = InProcessEngine(engine) if isinstance(engine, Engine) else engine
    state = ServerState(served, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.stopping = True
        if shutdown_engine:
            await asyncio.sleep(0.05)  # let cancelled requests unwind and queue their aborts first
            await asyncio.to_thread(served.shutdown)

    app = FastAPI(title="sglx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.sglx = state
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)

    install_common(app, state, [path for _, path, _ in ROUTES])
    return app
