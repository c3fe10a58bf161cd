"""Start the engine, print what attention backends run and why, serve with uvicorn, stop cleanly.

The LLM engine runs in a process of its own (sglx.server.engine_process), so the scheduler loop never waits
for the HTTP event loop's GIL; if that process dies, open requests fail with a 500, /health says why, and the
server exits with code 1.

SIGINT/SIGTERM: uvicorn stops accepting connections, gives in-flight requests `grace_period`
seconds, then cancels the rest (which aborts their engine requests); the engine is shut down and the
process exits 0. uvicorn itself would re-raise the signal after shutting down (exit 143/130); a
graceful stop is a success here.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from sglx.llm.engine_config import EngineConfig
from sglx.server.config import ServerConfig

log = logging.getLogger("sglx.server")


def startup_lines(info: dict[str, Any], model_name: str, config: ServerConfig) -> list[str]:
    """The banner: served model, attention backend(s) per phase and why they were chosen, KV pool."""
    prefill, decode = info["prefill_attention_backend"], info["decode_attention_backend"]
    backends = prefill if prefill == decode else f"prefill {prefill}, decode {decode}"
    return [
        f"[sglx] model {model_name} ({info['model_path']}), {info['architecture']}, {info['device']} {info['dtype']}",
        f"[sglx] attention backend: {backends} (selection: {info['selection']}; why: {info['why']})",
        f"[sglx] page size {info['page_size']}, KV cache {info['kv_cache_dtype']}, KV pool "
        f"{info['max_total_tokens']} tokens, context {info['context_length']}, max running requests "
        f"{info['max_running_requests']}",
        f"[sglx] serving on http://{config.host}:{config.port} (OpenAI API under /v1"
        f"{', API key required' if config.api_key else ''})",
    ]


def _graceful_server_class() -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn.Server that handles SIGINT/SIGTERM but does not re-raise them after shutting down."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            state = getattr(self.config.app, "state", None)
            if state is not None and hasattr(state, "sglx"):
                state.sglx.stopping = True  # /health answers 503 while draining
            super().handle_exit(sig, frame)

    return GracefulServer


def warm_up(engine: Any) -> None:
    """One small request before the port opens, so the first client does not wait for kernel compilation
    (Triton JIT, cuDNN plans); its prefix is flushed so the KV pool starts empty. Skipped while fp8 KV scales
    wait for the first prefill (--kv-cache-scales calibrate): its synthetic tokens would set them."""
    if (engine.info.get("kv_cache_scales") or {}).get("pending"):
        log.info("warm-up skipped: the fp8 KV scales are computed from the first real prefill")
        return
    vocab = engine.model_config.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(32)]
    engine.generate(input_ids=[ids, ids[:9]], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    engine.flush_cache()


def _serve(app: Any, config: ServerConfig, engine: Any = None) -> int:
    """Run uvicorn until a signal; with an EngineClient, also until its engine process dies (then exit 1)."""
    import uvicorn

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=config.grace_period, lifespan="on",
                               access_log=config.log_level == "debug")
    server = _graceful_server_class()(uv_config)
    if engine is not None:
        def stop(reason: str) -> None:  # from the client's reader thread; uvicorn polls should_exit
            app.state.sglx.stopping = True
            server.should_exit = True
        engine.on_death = stop
        if engine.death is not None:
            stop(engine.death)
    server.run()
    if not server.started:
        return 1  # e.g. the port is taken: uvicorn has logged why
    if engine is not None and engine.death is not None:
        print(f"[sglx] error: {engine.death}; server stopped", file=sys.stderr, flush=True)
        return 1
    print("[sglx] server stopped", file=sys.stderr, flush=True)
    return 0


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Blocking: serve until SIGINT/SIGTERM; returns the process exit code."""
    from sglx.server.app import create_app
    from sglx.server.engine_client import EngineClient, EngineExited

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = EngineClient.start(engine_config, config.log_level)  # loads and warms up (warm_up) the model
    except EngineExited as exc:  # torchrun's rank > 0: it served rank 0's engine and is done
        return exc.code
    try:
        app = create_app(engine, config, shutdown_engine=True)
        for line in startup_lines(engine.info, app.state.sglx.model_name, config):
            print(line, file=sys.stderr, flush=True)
        return _serve(app, config, engine)
    finally:
        engine.shutdown()


def diffusion_startup_lines(info: dict[str, Any], model_name: str, config: ServerConfig) -> list[str]:
    """The banner of a diffusion server: model, pipeline, attention backend and why, the queue limit."""
    d = info["defaults"]
    return [
        f"[sglx] model {model_name} ({info['model_path']}), {info['pipeline']}, --backend {info['backend']}, "
        f"{info['device']} {info['dtype']}" + (f", {sp}" if (sp := info.get("sequence_parallel")) else ""),
        f"[sglx] attention backend: {info['attention_backend']} (selection: {info['attention_source']}; why: "
        f"{info['attention_why']})",
        f"[sglx] defaults {d['width']}x{d['height']}, {d['num_frames']} frame(s) at {d['fps']} fps, "
        f"{d['num_inference_steps']} steps; one generation at a time, up to {config.max_queued_requests} waiting",
        f"[sglx] serving on http://{config.host}:{config.port} (POST /v1/images/generations, /v1/videos"
        f"{', API key required' if config.api_key else ''})",
    ]


def run_diffusion_server(engine_config: EngineConfig, config: ServerConfig, backend: str = "sglx") -> int:
    """Blocking: serve a diffusion model until SIGINT/SIGTERM; returns the process exit code."""
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.parallel.serving import SPServingEngine, wants_sequence_parallel
    from sglx.server.diffusion_app import create_diffusion_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if wants_sequence_parallel(engine_config, backend):  # --sp-size N: this process is rank 0 of N
        engine: Any = SPServingEngine(engine_config, backend=backend)
    else:
        engine = DiffusionEngine(engine_config, backend=backend)
    try:
        app = create_diffusion_app(engine, config)
        for line in diffusion_startup_lines(engine.info, app.state.sglx.model_name, config):
            print(line, file=sys.stderr, flush=True)
        return _serve(app, config)
    finally:
        engine.close()
