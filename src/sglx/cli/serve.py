"""`sglx serve`: argument handling only; the server is sglx.server's, the engine sglx.Engine's."""

from __future__ import annotations

import enum

import typer

from sglx.cli.engine_options import with_engine_options
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig
from sglx.server.config import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, LOG_LEVELS, ServerConfig

SERVER = "Server options"
DIFFUSION = "Diffusion options"
LogLevel = enum.Enum("LogLevel", {name: name for name in LOG_LEVELS}, type=str)  # type: ignore[misc]
Backend = enum.Enum("Backend", {"sglx": "sglx", "diffusers": "diffusers"}, type=str)  # type: ignore[misc]


def _diffusion_only(backend: str, max_queued_requests: int | None) -> list[str]:
    return (["--backend"] if backend != "sglx" else []) + (
        ["--max-queued-requests"] if max_queued_requests is not None else [])


@with_engine_options
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; loopback unless told otherwise "
                                                         "(0.0.0.0 serves the whole network).", rich_help_panel=SERVER),
    port: int = typer.Option(30000, "--port", help="TCP port.", rich_help_panel=SERVER),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SGLX_API_KEY", show_envvar=True,
                                       help="Require 'Authorization: Bearer <key>' on every route but /health.",
                                       rich_help_panel=SERVER),
    served_model_name: str | None = typer.Option(None, "--served-model-name",
                                                 help="Model id in the API (default: the model directory's name).",
                                                 rich_help_panel=SERVER),
    max_request_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BYTES, "--max-request-bytes",
                                          help="Larger request bodies are refused with 413.", rich_help_panel=SERVER),
    log_level: LogLevel = typer.Option("info", "--log-level", case_sensitive=False, help="Server log level.",
                                       rich_help_panel=SERVER),
    grace_period: float = typer.Option(10.0, "--grace-period", help="Seconds in-flight requests get to finish "
                                                                    "after SIGINT/SIGTERM before they are aborted.",
                                       rich_help_panel=SERVER),
    backend: Backend = typer.Option("sglx", "--backend", case_sensitive=False, rich_help_panel=DIFFUSION,
                                    help="Diffusion models: sglx's native pipeline, or diffusers' own pipeline "
                                         "(--attention-backend then takes diffusers' names)."),
    max_queued_requests: int | None = typer.Option(
        None, "--max-queued-requests", rich_help_panel=DIFFUSION, show_default=False,
        help=f"Diffusion models: generation jobs (images, videos) that may wait behind the running one; more are "
             f"refused with 503 (default {DEFAULT_MAX_QUEUED_REQUESTS})."),
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # filled by @with_engine_options
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (default: the tiny model embedded in sglx).

    A diffusion model (a diffusers directory or tiny-shapes) is served on /v1/images/generations and /v1/videos.
    """
    from sglx.diffusion.engine import resolve_diffusion_model_path
    from sglx.server.runner import run_diffusion_server, run_server

    backend_name = Backend(backend).value
    diffusion = resolve_diffusion_model_path(engine_config.model_path) is not None
    try:
        given = _diffusion_only(backend_name, max_queued_requests)
        if given and not diffusion:
            raise SglxError(f"{', '.join(given)} only apply to diffusion models; this is an LLM. Give a diffusion "
                            "model with --model-path (a diffusers directory, or tiny-shapes)")
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              max_request_bytes=max_request_bytes, log_level=LogLevel(log_level).value,
                              grace_period=grace_period, max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS
                              if max_queued_requests is None else max_queued_requests)
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        if diffusion:
            code = run_diffusion_server(engine_config, config, backend_name)
        elif engine_config.dp_size > 1:
            from sglx.cli.engine_options import engine_cli_args
            from sglx.server.dp_router import run_dp_server

            code = run_dp_server(engine_cli_args(engine_config, skip=("dp_size",)), engine_config.dp_size,
                                 engine_config.tp_size, engine_config.device, config)
        else:
            code = run_server(engine_config, config)
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)
