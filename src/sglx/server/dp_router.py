"""`sglx serve --dp-size N`: N engine replicas (each its own `sglx serve` process, with --tp-size GPUs of its
own on CUDA) behind one OpenAI-compatible endpoint; this process only routes.

Each request's body is forwarded unchanged (streaming responses are passed through as they arrive) to the
replica `CacheAwarePolicy` picks: the one whose radix cache most likely holds the prompt's prefix, else the
least-loaded one. Replicas listen on loopback ports of their own and get the same --api-key. A replica that
exits turns /health into 503 and every request into a one-line 503 naming it (no silently half-served
endpoint). SIGINT/SIGTERM stop the router gracefully, then every replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sglx.errors import SglxError
from sglx.server.config import ServerConfig
from sglx.server.dp_policy import CacheAwarePolicy

STARTUP_TIMEOUT_S = 900.0
ROUTED = ("/v1/completions", "/v1/chat/completions", "/generate")


@dataclass
class Replica:
    index: int
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        errors = [ln for ln in lines if ln.startswith("error:")]
        return (errors or lines or [""])[-1].strip()


def _die_with_parent() -> None:
    """In the replica, before exec: the kernel sends it SIGTERM when the router dies (even by SIGKILL)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def replica_gpus(dp_size: int, tp_size: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica: consecutive blocks of tp_size visible GPUs; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return [None] * dp_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if dp_size * tp_size > len(ids):
        raise SglxError(f"--dp-size {dp_size} x --tp-size {tp_size} needs {dp_size * tp_size} GPUs but "
                        f"{len(ids)} are visible; lower --dp-size or --tp-size")
    return [",".join(ids[i * tp_size:(i + 1) * tp_size]) for i in range(dp_size)]


def start_replicas(engine_args: list[str], dp_size: int, tp_size: int, device: str, config: ServerConfig,
                   log_dir: Path) -> list[Replica]:
    """Start every replica (`python -m sglx serve ENGINE_ARGS --port P`) and wait until each is healthy."""
    from sglx.distributed.spawn import find_free_port

    gpus = replica_gpus(dp_size, tp_size) if device != "cpu" else [None] * dp_size
    replicas: list[Replica] = []
    try:
        for i, visible in enumerate(gpus):
            port = find_free_port()
            env = dict(os.environ)
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            cmd = [sys.executable, "-m", "sglx", "serve", *engine_args, "--host", "127.0.0.1", "--port", str(port),
                   "--log-level", "warning", "--max-request-bytes", str(config.max_request_bytes),
                   "--grace-period", str(config.grace_period)]
            if config.served_model_name:
                cmd += ["--served-model-name", config.served_model_name]
            if config.api_key:
                env["SGLX_API_KEY"] = config.api_key  # not on the command line, where `ps` shows it
            log_path = log_dir / f"replica{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            replicas.append(Replica(i, port, proc, log_path))
        _wait_healthy(replicas, config.api_key)
    except BaseException:
        stop_replicas(replicas, 5.0)
        raise
    return replicas


def _wait_healthy(replicas: list[Replica], api_key: str | None) -> None:
    pending = {r.index: r for r in replicas}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while pending:
        for i, r in list(pending.items()):
            code = r.process.poll()
            if code is not None:
                raise SglxError(f"data-parallel replica {i} exited with code {code} while starting: "
                                f"{r.last_log_line() or 'no output'} (log: {r.log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{r.url}/health", timeout=1.0).status_code == 200:
                    del pending[i]
        if time.monotonic() > deadline:
            raise SglxError(f"data-parallel replicas {sorted(pending)} did not become healthy within "
                            f"{STARTUP_TIMEOUT_S:.0f} s")
        if pending:
            time.sleep(0.2)


def stop_replicas(replicas: list[Replica], grace_s: float) -> None:
    """SIGTERM every replica (each drains for its --grace-period), then SIGKILL what is left."""
    for r in replicas:
        if r.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 5.0
    for r in replicas:
        try:
            r.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.process.pid, signal.SIGKILL)
            r.process.wait(5.0)


def prompt_text(body: dict[str, Any]) -> str:
    """The text the routing policy keys on: the prompt, the chat messages, or /generate's text or token ids."""
    if "messages" in body and isinstance(body["messages"], list):
        return "\n".join(f"{m.get('role', '')}:{m.get('content', '')}" for m in body["messages"]
                         if isinstance(m, dict))
    for key in ("prompt", "text", "input_ids"):
        value = body.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            first = value[0]
            if isinstance(first, str):
                return first
            return " ".join(map(str, value if isinstance(first, int) else first))
    return ""


def create_router_app(replicas: list[Replica], config: ServerConfig) -> Any:
    """The front FastAPI app: routes generation requests, answers health/info/models/metrics for the fleet."""
    from sglx.server.app_base import install_common
    from sglx.server.errors import error_response
    from sglx.server.metrics import HttpMetrics, PromText

    policy = CacheAwarePolicy(len(replicas))

    class State:
        def __init__(self) -> None:
            self.config = config
            self.metrics = HttpMetrics()
            self.stopping = False
            self.client: httpx.AsyncClient | None = None

    state = State()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        yield
        await state.client.aclose()

    app = FastAPI(title="sglx data-parallel router", lifespan=lifespan)
    app.state.sglx = state

    def headers_of(request: Request) -> dict[str, str]:
        keep = ("authorization", "content-type", "accept")
        return {k: v for k, v in request.headers.items() if k.lower() in keep}

    def dead_replica() -> Replica | None:
        return next((r for r in replicas if r.process.poll() is not None), None)

    async def route(request: Request) -> Response:
        dead = dead_replica()
        if dead is not None:
            return error_response(503, f"data-parallel replica {dead.index} exited: {dead.last_log_line()}",
                                  code="replica_down")
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            body = {}
        index = policy.choose(prompt_text(body) if isinstance(body, dict) else "")
        replica = replicas[index]
        assert state.client is not None
        upstream = state.client.build_request(request.method, replica.url + request.url.path, content=raw,
                                              headers=headers_of(request), params=request.query_params)
        try:
            response = await state.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            policy.done(index)
            return error_response(502, f"data-parallel replica {index} did not answer: {type(exc).__name__}",
                                  code="replica_error")
        media = response.headers.get("content-type", "application/json")
        if "text/event-stream" not in media:
            try:
                content = await response.aread()
            finally:
                await response.aclose()
                policy.done(index)
            return Response(content, status_code=response.status_code, media_type=media)

        async def relay():  # type: ignore[no-untyped-def]
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
                policy.done(index)

        return StreamingResponse(relay(), status_code=response.status_code, media_type=media)

    for path in ROUTED:
        app.add_api_route(path, route, methods=["POST"])

    async def replica_json(path: str) -> Any:
        assert state.client is not None
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        response = await state.client.get(replicas[0].url + path, headers=headers)
        return response.status_code, response.json()

    @app.get("/health")
    async def health() -> Response:
        dead = dead_replica()
        if state.stopping or dead is not None:
            why = "stopping" if state.stopping else f"replica {dead.index} exited"  # type: ignore[union-attr]
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": len(replicas)})

    @app.get("/v1/models")
    async def models() -> Response:
        status, data = await replica_json("/v1/models")
        return JSONResponse(data, status_code=status)

    @app.get("/server_info")
    async def server_info() -> Response:
        status, data = await replica_json("/server_info")
        if isinstance(data, dict):
            data["dp_size"] = len(replicas)
            data["router"] = {"policy": "cache_aware", "cache_threshold": policy.cache_threshold,
                              "replicas": [{**s, "port": r.port} for s, r in zip(policy.stats(), replicas)]}
        return JSONResponse(data, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        out = PromText()
        state.metrics.render_http(out)
        for s in policy.stats():
            for key in ("routed", "in_flight", "prefix_hits"):
                out.value(f'sglx_router_{key}{{replica="{s["replica"]}"}}', "gauge",
                          f"router: {key.replace('_', ' ')} per data-parallel replica", s[key])
        return PlainTextResponse(out.text(), media_type="text/plain; version=0.0.4")

    install_common(app, state, [*ROUTED, "/health", "/v1/models", "/server_info", "/metrics"])
    return app


def run_dp_server(engine_args: list[str], dp_size: int, tp_size: int, device: str, config: ServerConfig) -> int:
    """Blocking: start the replicas, serve the router until SIGINT/SIGTERM, stop everything; the exit code."""
    import logging

    from sglx.server.runner import _serve

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    log_dir = Path(tempfile.mkdtemp(prefix="sglx-dp-"))
    print(f"[sglx] starting {dp_size} data-parallel replicas (tp {tp_size} each); logs in {log_dir}",
          file=sys.stderr, flush=True)
    replicas = start_replicas(engine_args, dp_size, tp_size, device, config, log_dir)
    try:
        app = create_router_app(replicas, config)
        print(f"[sglx] {dp_size} replicas on ports {', '.join(str(r.port) for r in replicas)}; routing "
              f"(cache-aware) on http://{config.host}:{config.port}{', API key required' if config.api_key else ''}",
              file=sys.stderr, flush=True)
        return _serve(app, config)
    finally:
        stop_replicas(replicas, config.grace_period)
        if all(r.process.returncode in (0, -signal.SIGTERM) for r in replicas):
            shutil.rmtree(log_dir, ignore_errors=True)  # the logs are kept only when a replica failed
