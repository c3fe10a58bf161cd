"""`sglx bench`: benchmark sub-commands (serving here; attention and one-batch join the same sub-app)."""

from __future__ import annotations

import asyncio
import enum
import json
import math
from pathlib import Path

import typer

from sglx.errors import SglxError

bench_app = typer.Typer(name="bench", help="Benchmarks: serving load against an OpenAI-compatible endpoint.",
                        no_args_is_help=True)

Endpoint = enum.Enum("Endpoint", {"completions": "completions", "chat": "chat"}, type=str)  # type: ignore[misc]
LengthDist = enum.Enum("LengthDist", {"uniform": "uniform", "normal": "normal"}, type=str)  # type: ignore[misc]
PromptKind = enum.Enum("PromptKind", {k: k for k in ("auto", "token-ids", "text")}, type=str)  # type: ignore[misc]


@bench_app.command("serving")
def serving(
    base_url: str = typer.Option("http://127.0.0.1:30000", "--base-url",
                                 help="Server root (ours or any OpenAI-compatible one)."),
    model: str | None = typer.Option(None, "--model", help="Model id (default: the server's first /v1/models)."),
    endpoint: Endpoint = typer.Option("completions", "--endpoint", help="/v1/completions or /v1/chat/completions."),
    num_prompts: int = typer.Option(200, "--num-prompts", help="Requests to send."),
    request_rate: float = typer.Option(math.inf, "--request-rate",
                                       help="Requests per second, Poisson arrivals (default inf: all at once)."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="Most requests in flight at once."),
    random_input_len: int = typer.Option(256, "--random-input-len", help="Longest prompt, in tokens."),
    random_output_len: int = typer.Option(128, "--random-output-len", help="Longest output (max_tokens)."),
    random_range_ratio: float = typer.Option(1.0, "--random-range-ratio",
                                             help="Lengths lie in [ratio * len, len]; 1.0 = all the same."),
    length_dist: LengthDist = typer.Option("uniform", "--length-dist",
                                           help="How lengths spread over that range."),
    prompt_kind: PromptKind = typer.Option(
        "auto", "--prompt-kind",
        help="token-ids (exact lengths; vocabulary from sglx's /server_info or --vocab-size), text (from "
             "--tokenizer's vocabulary, else random words); auto picks token-ids when it can."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="HF tokenizer directory for text prompts."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="Vocabulary size for token-id prompts."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Ask for exactly max_tokens (vLLM/SGLang extension)."),
    temperature: float = typer.Option(0.0, "--temperature"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="SGLX_API_KEY", show_envvar=True,
                                       help="Sent as 'Authorization: Bearer <key>'."),
    seed: int = typer.Option(0, "--seed", help="Seed of prompts, lengths and arrival times."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    output_file: Path | None = typer.Option(None, "--output-file", help="Also write the JSON report here."),
    disable_progress: bool = typer.Option(False, "--disable-progress", help="No progress bar."),
) -> None:
    """Load-test a serving endpoint: throughput, TTFT, inter-token and end-to-end latency (mean, median, p99)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sglx.bench.serving import ServingBenchConfig, run_benchmark
    from sglx.bench.serving_report import report_table

    try:
        config = ServingBenchConfig(
            base_url=base_url, model=model, endpoint=Endpoint(endpoint).value, num_prompts=num_prompts,
            request_rate=request_rate, max_concurrency=max_concurrency, input_len=random_input_len,
            output_len=random_output_len, range_ratio=random_range_ratio, length_dist=LengthDist(length_dist).value,
            prompt_kind=PromptKind(prompt_kind).value, tokenizer=str(tokenizer) if tokenizer else None,
            vocab_size=vocab_size, ignore_eos=ignore_eos, temperature=temperature, api_key=api_key, seed=seed)
        err = Console(stderr=True)
        with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                      TimeElapsedColumn(), console=err, disable=disable_progress, transient=True) as progress:
            task = progress.add_task("requests", total=num_prompts, failed="")
            failed = [0]

            def done(outcome: object) -> None:
                if not getattr(outcome, "success", False):
                    failed[0] += 1
                progress.update(task, advance=1, failed=f"{failed[0]} failed" if failed[0] else "")

            report = asyncio.run(run_benchmark(config, done))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    text = json.dumps(report, indent=2)
    if output_file is not None:
        output_file.write_text(text + "\n", encoding="utf-8")
    if json_output:
        typer.echo(text)
    else:
        Console().print(report_table(report))
        for message in report["errors"]:
            typer.echo(f"error: {message}", err=True)
    if report["failed"]:
        raise typer.Exit(1)
