"""GET /health, /v1/models, /server_info, /metrics and POST /flush_cache: what runs and how loaded it is."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from sglx import __version__
from sglx.server.config import ServerConfig
from sglx.server.engine_state import kv_pool_info, metric_gauges
from sglx.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.sglx


def health_response(serving: bool, failure: BaseException | str | None = None) -> Response:
    """200 while the server takes requests; 503 while it drains or its engine stopped (load balancers look here).

    `failure`: why the engine cannot serve any more (a rank of its parallel group died), its one line in "error"."""
    if failure is not None:
        return JSONResponse({"status": "unavailable", "error": str(failure)}, status_code=503)
    return JSONResponse({"status": "ok"} if serving else {"status": "unavailable"}, status_code=200 if serving else 503)


def model_list(state: Any, root: str, **extra: Any) -> Response:
    """/v1/models: the one served model (state: any server state with model_name and created)."""
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "sglx", "root": root,
        **extra}]})


async def health(request: Request) -> Response:
    state = _state(request)
    alive, failure = await state.engine.health()  # failure: e.g. a dead tensor-parallel rank, its one line
    return health_response(not state.stopping and alive, failure)


async def models(request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    return model_list(state, engine.model_path, max_model_len=engine.context_length)


def attention_summary(info: dict[str, Any]) -> dict[str, Any]:
    return {"prefill": info["prefill_attention_backend"], "decode": info["decode_attention_backend"],
            "selection": info["selection"], "why": info["why"], "page_size": info["page_size"],
            "kv_cache_dtype": info["kv_cache_dtype"]}


def server_options(cfg: ServerConfig) -> dict[str, Any]:
    """The server's own options as /server_info reports them (never the API key itself)."""
    return {"host": cfg.host, "port": cfg.port, "max_request_bytes": cfg.max_request_bytes,
            "api_key_required": cfg.api_key is not None, "grace_period": cfg.grace_period,
            "log_level": cfg.log_level, "max_queued_requests": cfg.max_queued_requests}


async def server_info(request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    load = await engine.load()
    info = await engine.current_info()
    return JSONResponse({
        "version": __version__,
        "served_model_name": state.model_name,
        "model_path": str(info["model_path"]),
        "architecture": info["architecture"],
        "vocab_size": engine.vocab_size,
        "attention": attention_summary(info),
        "engine": info,
        "engine_config": engine.config.to_dict(),
        "kv_pool": kv_pool_info(load),
        "scheduler": {"running_requests": load["running_requests"], "queued_requests": load["queued_requests"]},
        "server": server_options(state.config),
    })


async def metrics(request: Request) -> Response:
    state = _state(request)
    load = await state.engine.load()
    return PlainTextResponse(state.metrics.render(metric_gauges(load)), media_type="text/plain; version=0.0.4")


async def flush_cache(request: Request) -> Response:
    """Evict every unused cached prefix (SGLang's /flush_cache); answers the free KV slots afterwards."""
    state = _state(request)
    free = await state.engine.flush_cache()
    return JSONResponse({"kv_free": free})
