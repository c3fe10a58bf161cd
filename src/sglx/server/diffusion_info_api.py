"""GET /health, /v1/models, /server_info, /metrics of a diffusion server, and the LLM routes' clear refusal."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sglx import __version__
from sglx.server.diffusion_state import DiffusionServerState
from sglx.server.errors import APIError
from sglx.server.info_api import health_response, model_list, server_options


def _state(request: Request) -> DiffusionServerState:
    return request.app.state.sglx


async def health(request: Request) -> Response:
    state = _state(request)
    return health_response(not state.stopping and state.queue.alive, getattr(state.engine, "failure", None))


async def models(request: Request) -> Response:
    state = _state(request)
    return model_list(state, str(state.engine.info["model_path"]))


async def server_info(request: Request) -> Response:
    state = _state(request)
    info = state.engine.info
    queue = state.queue
    return JSONResponse({
        "version": __version__,
        "served_model_name": state.model_name,
        "model_path": str(info["model_path"]),
        "kind": "diffusion",
        "pipeline": info["pipeline"],
        "attention": {"backend": info["attention_backend"], "selection": info["attention_source"],
                      "why": info["attention_why"]},
        "engine": info,
        "engine_config": state.engine.config.to_dict(),
        "queue": {"running": int(queue.running is not None), "queued": len(queue.waiting),
                  "max_queued": queue.max_queued},
        "videos": state.videos.counts(),
        "server": server_options(state.config),
    })


async def metrics(request: Request) -> Response:
    state = _state(request)
    text = state.metrics.render(len(state.queue.waiting), int(state.queue.running is not None), state.videos.counts())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def llm_only(request: Request) -> Response:
    raise APIError(400, f"{request.url.path} is for language models, but this server runs a diffusion model "
                        f"({_state(request).model_name}); use POST /v1/images/generations or POST /v1/videos",
                   code="wrong_model_kind")
