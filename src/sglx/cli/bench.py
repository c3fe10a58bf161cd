"""`sglx bench`: benchmark sub-commands (serving, offline-throughput, attention, one-batch); argument handling only."""

from __future__ import annotations

import asyncio
import enum
import json
import math
from pathlib import Path

import typer

from sglx.cli.engine_options import llm_backend_names, with_engine_options
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

bench_app = typer.Typer(name="bench", help="Benchmarks: serving load against an OpenAI-compatible endpoint, "
                                             "attention kernels against baselines, one-batch engine latency.",
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
                                             help="Lengths lie between ratio * len and len; 1.0 = all the same."),
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
    offline_result: Path | None = typer.Option(
        None, "--offline-result", help="JSON of `sglx bench offline-throughput` on the same options: the report "
                                       "adds serving/offline throughput ratios (the prompts must be identical)."),
) -> None:
    """Load-test a serving endpoint: throughput, TTFT, inter-token and end-to-end latency (mean, p50, p90, p99)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sglx.bench.serving import ServingBenchConfig, run_benchmark
    from sglx.bench.serving_report import report_table, vs_offline

    try:
        offline = _read_offline(offline_result) if offline_result is not None else None
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
        if offline is not None:
            report["vs_offline"] = vs_offline(report, offline, str(offline_result))
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


def _read_offline(path: Path) -> dict:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        raise SglxError(f"--offline-result {path}: cannot read a JSON object ({type(exc).__name__}: {exc}); give "
                        "the file `sglx bench offline-throughput --output-file` wrote") from None


@bench_app.command("offline-throughput")
@with_engine_options
def offline_throughput(
    num_prompts: int = typer.Option(200, "--num-prompts", help="Requests to generate."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency",
                                               help="Most requests in the engine at once (default: all at once)."),
    random_input_len: int = typer.Option(256, "--random-input-len", help="Longest prompt, in tokens."),
    random_output_len: int = typer.Option(128, "--random-output-len", help="Longest output (max_tokens)."),
    random_range_ratio: float = typer.Option(1.0, "--random-range-ratio",
                                             help="Lengths lie between ratio * len and len; 1.0 = all the same."),
    length_dist: LengthDist = typer.Option("uniform", "--length-dist", help="How lengths spread over that range."),
    prompt_kind: PromptKind = typer.Option("auto", "--prompt-kind",
                                           help="As `sglx bench serving --prompt-kind` (auto: token ids)."),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="HF tokenizer directory for text prompts."),
    vocab_size: int | None = typer.Option(None, "--vocab-size",
                                          help="Vocabulary of token-id prompts (default: the model's)."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Generate exactly max_tokens."),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed", help="Seed of prompts and lengths (as `sglx bench serving`)."),
    skip_warmup: bool = typer.Option(False, "--skip-warmup", help="No warm-up request before timing."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    output_file: Path | None = typer.Option(None, "--output-file", help="Also write the JSON report here."),
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # filled by @with_engine_options
) -> None:
    """The engine's throughput without a server, on the prompts `sglx bench serving` sends with the same options.

    Give it the flags you give `sglx serve`; then `sglx bench serving --offline-result FILE` reports the ratio.
    """
    from rich.console import Console

    from sglx.bench.offline_throughput import OfflineBenchConfig, offline_table, run_offline_throughput

    try:
        config = OfflineBenchConfig(
            num_prompts=num_prompts, input_len=random_input_len, output_len=random_output_len,
            range_ratio=random_range_ratio, length_dist=LengthDist(length_dist).value,
            prompt_kind=PromptKind(prompt_kind).value, tokenizer=str(tokenizer) if tokenizer else None,
            vocab_size=vocab_size, ignore_eos=ignore_eos, temperature=temperature, seed=seed,
            max_concurrency=max_concurrency, warmup=not skip_warmup)
        err = Console(stderr=True)
        report = run_offline_throughput(engine_config, config, progress=lambda m: err.print(f"[dim]{m}[/]"))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _finish(report, json_output, output_file, offline_table(report), report["errors"])  # failed > 0 iff errors


Phase = enum.Enum("Phase", {k: k for k in ("decode", "prefill")}, type=str)  # type: ignore[misc]
BenchDtype = enum.Enum("BenchDtype", {k: k for k in ("bfloat16", "float16", "float32")}, type=str)  # type: ignore[misc]
KvDtype = enum.Enum("KvDtype", {k: k for k in ("auto", "fp8_e4m3", "fp8_e5m2")}, type=str)  # type: ignore[misc]
Device = enum.Enum("Device", {k: k for k in ("auto", "cpu", "cuda")}, type=str)  # type: ignore[misc]
LLMBackend = enum.Enum("LLMBackend", {k: k for k in llm_backend_names()}, type=str)  # type: ignore[misc]
SHAPES = "Shapes (default: per device and phase; see --help text)"


def _write_report(report: dict, json_output: bool, output: Path | None, table: object) -> None:
    from rich.console import Console

    text = json.dumps(report, indent=1, default=str)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n", encoding="utf-8")
    if json_output:
        typer.echo(text)
    else:
        Console(width=200).print(table)


def _finish(report: dict, json_output: bool, output: Path | None, table: object, failures: list[str]) -> None:
    """Write the report, then one `error:` line per failure and exit code 1 if there was any."""
    _write_report(report, json_output, output, table)
    for message in failures:
        typer.echo(f"error: {message}", err=True)
    if failures:
        raise typer.Exit(1)


def _prefill_shape(text: str) -> tuple[int, int]:
    prefix, sep, new = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(prefix), int(new)
    except ValueError:
        raise SglxError(f"--prefill-shape {text}: write PREFIX:NEW, e.g. 0:4096 or 4096:512") from None


@bench_app.command("attention")
def attention(
    backend: list[LLMBackend] | None = typer.Option(  # type: ignore[valid-type]
        None, "--backend", case_sensitive=False,
        help="sglx LLM backend to time (repeatable; default: every implemented backend usable here)."),
    phase: list[Phase] | None = typer.Option(None, "--phase", help="decode and/or prefill (default: both)."),  # type: ignore[valid-type]
    batch_size: int | None = typer.Option(None, "--batch-size", help="Requests (GPU default: decode 64, "
                                          "prefill 4; CPU: 2).", rich_help_panel=SHAPES),
    num_q_heads: int | None = typer.Option(None, "--num-q-heads", help="Query heads (GPU 32, CPU 4).",
                                           rich_help_panel=SHAPES),
    num_kv_heads: int | None = typer.Option(None, "--num-kv-heads", help="KV heads (GPU: decode 8, prefill "
                                            "= query heads; CPU: decode 2, prefill 4).", rich_help_panel=SHAPES),
    head_dim: int | None = typer.Option(None, "--head-dim", help="Head dim (GPU 128, CPU 64).",
                                        rich_help_panel=SHAPES),
    context_len: list[int] | None = typer.Option(None, "--context-len", help="Decode: keys per request, "
                                                 "repeatable (GPU 4096, CPU 64).", rich_help_panel=SHAPES),
    prefill_shape: list[str] | None = typer.Option(None, "--prefill-shape", help="Prefill PREFIX:NEW, causal, "
                                                   "repeatable (GPU 0:4096 and 4096:512; CPU 0:32 and 32:8).",
                                                   rich_help_panel=SHAPES),
    page_size: list[int] | None = typer.Option(None, "--page-size", help="KV page size, repeatable (default: "
                                               "decode 1 and 16, prefill 16).", rich_help_panel=SHAPES),
    dtype: BenchDtype | None = typer.Option(None, "--dtype", help="Compute dtype (GPU bfloat16, CPU float32).",  # type: ignore[valid-type]
                                            rich_help_panel=SHAPES),
    kv_cache_dtype: list[KvDtype] | None = typer.Option(  # type: ignore[valid-type]
        None, "--kv-cache-dtype", help="KV storage, repeatable (GPU decode: auto and fp8_e4m3; else auto).",
        rich_help_panel=SHAPES),
    device: Device = typer.Option("auto", "--device", help="auto = cuda when available."),  # type: ignore[valid-type]
    no_baselines: bool = typer.Option(False, "--no-baselines", help="Skip SDPA and FlashInfer."),
    warmup_ms: float | None = typer.Option(None, "--warmup-ms", help="Warm-up time per timed call."),
    rep_ms: float | None = typer.Option(None, "--rep-ms", help="Time spent on timed runs per call (median)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    cuda_graph: bool = typer.Option(False, "--cuda-graph", help="Time decode calls as CUDA graph replays, as the "
                                    "engine runs decode steps (CUDA only; sglx backends through their graph hooks)."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    output: Path | None = typer.Option(None, "--output", help="Also write the JSON report here."),
) -> None:
    """Check, then time, LLM attention backends per phase and shape against SDPA (cuDNN) and FlashInfer."""
    from rich.console import Console

    from sglx.bench.attention import AttentionBenchConfig, report_table, run_attention_bench

    try:
        config = AttentionBenchConfig(
            backends=tuple(LLMBackend(b).value for b in backend or ()),
            phases=tuple(Phase(p).value for p in phase or ()) or ("decode", "prefill"),
            batch_size=batch_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            context_lens=tuple(context_len or ()), prefill_shapes=tuple(_prefill_shape(s) for s in prefill_shape or ()),
            page_sizes=tuple(page_size or ()), dtype=BenchDtype(dtype).value if dtype else None,
            kv_cache_dtypes=tuple(KvDtype(k).value for k in kv_cache_dtype or ()), device=Device(device).value,
            baselines=not no_baselines, warmup_ms=warmup_ms, rep_ms=rep_ms, seed=seed, cuda_graph=cuda_graph)
        err = Console(stderr=True)
        report = run_attention_bench(config, progress=lambda m: err.print(f"[dim]{m}[/]"))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _finish(report, json_output, output, report_table(report), report["failed"])


def _batch_sizes(values: list[str] | None) -> tuple[int, ...]:
    out = []
    for value in values or ["1"]:
        for part in value.split(","):
            try:
                out.append(int(part))
            except ValueError:
                raise SglxError(f"--batch-size {value}: give integers, e.g. --batch-size 1 --batch-size 64 "
                                "or --batch-size 1,64") from None
    return tuple(out)


@bench_app.command("one-batch")
@with_engine_options
def one_batch(
    batch_size: list[str] | None = typer.Option(None, "--batch-size",
                                                help="Batch size(s): repeatable or comma-separated (default 1)."),
    input_len: int = typer.Option(512, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(16, "--output-len", help="Generated tokens per request (1 from the prefill, "
                                   "the rest from decode steps)."),
    prefill_runs: int = typer.Option(5, "--prefill-runs", help="Timed prefills after the warm-up one (median "
                                     "reported)."),
    prefill_floor: bool = typer.Option(True, "--prefill-floor/--no-prefill-floor",
                                       help="Also time the prefill's GEMMs and SDPA attention alone (its compute "
                                            "floor, same run)."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON instead of a table."),
    output: Path | None = typer.Option(None, "--output", help="Also write the JSON report here."),
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # filled by @with_engine_options
) -> None:
    """Latency of one static batch without a server: prefill against its compute floor (GEMMs + attention),
    per-step decode against the memory-roofline floor.

    E.g. `sglx bench one-batch --model-path llama-3.1-8b --load-format dummy --batch-size 1,64`.
    """
    from rich.console import Console

    from sglx.bench.one_batch import OneBatchConfig, report_table, run_one_batch

    try:
        config = OneBatchConfig(batch_sizes=_batch_sizes(batch_size), input_len=input_len, output_len=output_len,
                                prefill_runs=prefill_runs, prefill_floor=prefill_floor)
        err = Console(stderr=True)
        report = run_one_batch(engine_config, config, progress=lambda m: err.print(f"[dim]{m}[/]"))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _write_report(report, json_output, output, report_table(report))


def _diffusion_backend_names() -> tuple[str, ...]:
    from sglx.attention.registry import backend_names

    return backend_names("diffusion")


DiffusionBackend = enum.Enum("DiffusionBackend", {k: k for k in _diffusion_backend_names()},  # type: ignore[misc]
                             type=str)
DiTShapeName = enum.Enum("DiTShapeName", {k: k for k in ("wan-1.3b", "wan-14b-720p", "flux-1024", "tiny-video",  # type: ignore[misc]
                                                          "tiny-joint")}, type=str)


@bench_app.command("diffusion")
def diffusion(
    backend: list[DiffusionBackend] | None = typer.Option(  # type: ignore[valid-type]
        None, "--backend", case_sensitive=False,
        help="sglx diffusion backend for the attention part (repeatable; default: every one usable here)."),
    shape: list[DiTShapeName] | None = typer.Option(  # type: ignore[valid-type]
        None, "--shape", help="DiT attention shape, repeatable (GPU default: wan-1.3b, wan-14b-720p, flux-1024; "
                              "CPU: tiny-video, tiny-joint)."),
    step_backend: DiffusionBackend | None = typer.Option(  # type: ignore[valid-type]
        None, "--step-backend", case_sensitive=False, help="sglx backend of the Wan step (default: auto)."),
    attention_only: bool = typer.Option(False, "--attention-only", help="Skip the Wan denoising step."),
    step_only: bool = typer.Option(False, "--step-only", help="Skip the attention shapes."),
    num_frames: int = typer.Option(81, "--num-frames", help="Wan step: video frames (4k+1)."),
    height: int = typer.Option(480, "--height", help="Wan step: video height in pixels."),
    width: int = typer.Option(832, "--width", help="Wan step: video width in pixels."),
    num_layers: int | None = typer.Option(None, "--num-layers", help="Wan step: transformer blocks (default 30)."),
    tiny: bool = typer.Option(False, "--tiny", help="Wan step: a 2-layer toy of the same architecture (CPU)."),
    dtype: BenchDtype | None = typer.Option(None, "--dtype", help="Compute dtype (GPU bfloat16, CPU float32)."),  # type: ignore[valid-type]
    device: Device = typer.Option("auto", "--device", help="auto = cuda when available."),  # type: ignore[valid-type]
    no_baselines: bool = typer.Option(False, "--no-baselines", help="Attention: skip cuDNN/flash SDPA and FA4."),
    warmup_ms: float | None = typer.Option(None, "--warmup-ms", help="Warm-up time per timed call."),
    rep_ms: float | None = typer.Option(None, "--rep-ms", help="Time spent on timed runs per call (median)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs and weights."),
    attention_backend: list[str] | None = typer.Option(
        None, "--attention-backend",
        help="Sparse comparison: backends to put side by side on --canvas (repeatable or comma list; sparse and "
             "dense ones), with dense baselines, FlexAttention at each sparse mask and fastvideo-kernel where it "
             "imports. Runs instead of the shape table and the Wan step."),
    attention_backend_config: list[str] | None = typer.Option(
        None, "--attention-backend-config",
        help="Config of a compared backend (file, JSON or k=v), repeatable: paired with --attention-backend by "
             "position, or prefixed NAME: (e.g. video_sparse_attn:sparsity=0.875)."),
    canvas: str | None = typer.Option(
        None, "--canvas",
        help="Sparse comparison: latent token grid TxHxW, e.g. 18x48x80 (default: Wan's grid of "
             "--num-frames/--height/--width)."),
    heads: int = typer.Option(12, "--heads", help="Sparse comparison: attention heads."),
    head_dim: int = typer.Option(128, "--head-dim", help="Sparse comparison: head dimension."),
    text_tokens: int = typer.Option(0, "--text-tokens", help="Sparse comparison: joint text tokens before the video."),
    layer: int | None = typer.Option(None, "--layer", help="Sparse comparison: DiT layer of the call (default: the "
                                                          "last of --num-layers; VMoBA cycles chunk shapes by layer)."),
    no_anchors: bool = typer.Option(False, "--no-anchors", help="Sparse comparison: skip FlexAttention and "
                                                                "fastvideo-kernel at each sparse mask."),
    logit_std: float = typer.Option(1.0, "--logit-std", help="Sparse comparison: spread (std) of the synthetic "
                                    "logits q.k/sqrt(D). Top-p selection (SVG2) keeps more blocks when they are "
                                    "flat; 5 gives the inputs of benchmarks/bench_sparse_backends.py."),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    output: Path | None = typer.Option(None, "--output", help="Also write the JSON report here."),
) -> None:
    """DiT attention at Wan/FLUX shapes vs cuDNN SDPA and FA4, and one dummy Wan2.1-1.3B step vs diffusers.

    With --attention-backend: those backends (sparse ones with their configs) side by side on one canvas, e.g.
    `sglx bench diffusion --canvas 18x48x80 --attention-backend video_sparse_attn,vmoba_attn
    --attention-backend-config video_sparse_attn:sparsity=0.875`."""
    from rich.console import Console

    from sglx.bench.diffusion import DiffusionAttentionBenchConfig
    from sglx.bench.diffusion_report import report_tables, run_diffusion_bench
    from sglx.bench.diffusion_step import StepConfig
    from sglx.llm.model_runner import resolve_device

    try:
        if attention_backend or attention_backend_config or canvas:
            return _sparse_compare(attention_backend or [], attention_backend_config or [], canvas, num_frames,
                                   height, width, heads, head_dim, text_tokens, num_layers, layer, dtype, device,
                                   no_baselines, no_anchors, warmup_ms, rep_ms, seed, json_output, output,
                                   logit_std)
        if attention_only and step_only:
            raise SglxError("--attention-only and --step-only exclude each other")
        dev = resolve_device(Device(device).value)
        dt = BenchDtype(dtype).value if dtype else None
        att = None if step_only else DiffusionAttentionBenchConfig(
            shapes=tuple(DiTShapeName(s).value for s in shape or ()),
            backends=tuple(DiffusionBackend(b).value for b in backend or ()), dtype=dt,
            baselines=not no_baselines, warmup_ms=warmup_ms, rep_ms=rep_ms, seed=seed)
        step = None if attention_only else StepConfig(
            frames=num_frames, height=height, width=width, num_layers=num_layers,
            backend=DiffusionBackend(step_backend).value if step_backend else None,
            dtype=dt or ("bfloat16" if dev.type == "cuda" else "float32"), tiny=tiny, warmup_ms=warmup_ms,
            rep_ms=rep_ms, seed=seed)
        err = Console(stderr=True)
        with err.status("sglx bench diffusion") as status:
            report = run_diffusion_bench(att, step, dev, progress=lambda m: status.update(m))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _finish(report, json_output, output, report_tables(report), report["failed"])


def _sparse_compare(backends: list[str], configs: list[str], canvas: str | None, frames: int, height: int,
                    width: int, heads: int, head_dim: int, text_tokens: int, num_layers: int | None,
                    layer: int | None, dtype: object, device: object, no_baselines: bool, no_anchors: bool,
                    warmup_ms: float | None, rep_ms: float | None, seed: int, json_output: bool,
                    output: Path | None, logit_std: float) -> None:
    """`sglx bench diffusion --attention-backend ...`: parse, run sglx.bench.diffusion_sparse, print."""
    from rich.console import Console

    from sglx.bench.diffusion_report import environment
    from sglx.bench.diffusion_sparse import (
        SparseCompareConfig,
        canvas_from_video,
        compare_table,
        pair_backends,
        parse_canvas,
        run_sparse_compare,
    )
    from sglx.llm.model_runner import resolve_device, snapshot_for

    try:
        grid = parse_canvas(canvas) if canvas else canvas_from_video(frames, height, width)
        config = SparseCompareConfig(
            canvas=grid, backends=pair_backends(backends, configs), heads=heads, head_dim=head_dim,
            text_tokens=text_tokens, num_layers=num_layers or 30, layer=layer,
            dtype=BenchDtype(dtype).value if dtype else None, baselines=not no_baselines, anchors=not no_anchors,
            warmup_ms=warmup_ms, rep_ms=rep_ms, seed=seed, logit_std=logit_std)
        dev = resolve_device(Device(device).value)
        err = Console(stderr=True)
        with err.status("sglx bench diffusion (sparse comparison)") as status:
            sparse = run_sparse_compare(config, dev, snapshot_for(dev), progress=lambda m: status.update(m))
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    failed = [f"{r['backend']}: {r['error']}" for r in sparse["rows"] if r["kind"] == "sglx" and r.get("error")]
    report = {"environment": environment(dev), "sparse": sparse, "failed": failed}
    _finish(report, json_output, output, compare_table(report), failed)
