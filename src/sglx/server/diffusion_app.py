"""The FastAPI app of a diffusion server: images, videos and the info routes over one DiffusionEngine.

It shares the LLM app's middleware and error handlers (app_base.install_common). Generations run one
at a time through a GenerationQueue started in the app's lifespan; on shutdown (after uvicorn's grace
period for in-flight requests) waiting jobs are cancelled and the running one stops at its next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from sglx.server import diffusion_info_api, images_api, videos_api
from sglx.server.app_base import install_common
from sglx.server.config import ServerConfig
from sglx.server.diffusion_queue import GenerationQueue
from sglx.server.diffusion_state import DiffusionServerState

ROUTES = (
    ("GET", "/health", diffusion_info_api.health),
    ("GET", "/v1/models", diffusion_info_api.models),
    ("GET", "/server_info", diffusion_info_api.server_info),
    ("GET", "/metrics", diffusion_info_api.metrics),
    ("POST", "/v1/images/generations", images_api.generations),
    ("POST", "/v1/videos", videos_api.create),
    ("GET", "/v1/videos", videos_api.list_videos),
    ("GET", "/v1/videos/{video_id}", videos_api.retrieve),
    ("DELETE", "/v1/videos/{video_id}", videos_api.delete),
    ("GET", "/v1/videos/{video_id}/content", videos_api.content),
    ("POST", "/v1/completions", diffusion_info_api.llm_only),
    ("POST", "/v1/chat/completions", diffusion_info_api.llm_only),
    ("POST", "/generate", diffusion_info_api.llm_only),
    ("POST", "/flush_cache", diffusion_info_api.llm_only),
)


def create_diffusion_app(engine: Any, config: ServerConfig | None = None) -> FastAPI:
    """The app over a loaded DiffusionEngine (the caller closes the engine once the server stopped)."""
    config = config or ServerConfig()
    state = DiffusionServerState(engine, config, GenerationQueue(config.max_queued_requests))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.queue.start()
        yield
        state.stopping = True
        await state.queue.stop()

    app = FastAPI(title="sglx", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.sglx = state
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], include_in_schema=False)
    install_common(app, state, [path for _, path, _ in ROUTES])
    return app
