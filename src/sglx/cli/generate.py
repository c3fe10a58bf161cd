"""`sglx generate`: argument handling only; generation is sglx.Engine's."""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Any

import typer

from sglx.cli.diffusion_generate import DiffusionFlags, is_diffusion_model, run_diffusion
from sglx.cli.engine_options import with_engine_options
from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig

SAMPLING = "Sampling options"
DIFFUSION = "Diffusion options"
Backend = enum.Enum("Backend", {"sglx": "sglx", "diffusers": "diffusers"}, type=str)  # type: ignore[misc]


def _read_prompts(prompts: list[str] | None, prompts_file: Path | None) -> list[Any]:
    """Prompts from --prompt (repeatable) and --prompts-file: text lines, or JSONL with "prompt"/"messages"."""
    out: list[Any] = list(prompts or [])
    if prompts_file is not None:
        if str(prompts_file) == "-":
            text = sys.stdin.read()
        else:
            try:
                text = prompts_file.read_text(encoding="utf-8")
            except OSError as exc:
                raise SglxError(f"--prompts-file {prompts_file}: {exc.strerror or exc}") from exc
        jsonl = prompts_file.suffix == ".jsonl"
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if not jsonl:
                out.append(line)
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SglxError(f"--prompts-file {prompts_file}, line {n}: not JSON ({exc.msg})") from exc
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                out.append(item["prompt"])
            elif isinstance(item, dict) and isinstance(item.get("messages"), list):
                out.append(item["messages"])
            else:
                raise SglxError(f"--prompts-file {prompts_file}, line {n}: expected a string or an object with "
                                "\"prompt\" (text) or \"messages\" (chat)")
    if not out:
        raise SglxError("nothing to generate: give --prompt TEXT (repeatable) or --prompts-file FILE")
    return out


def _as_chat(prompt: Any, system: str | None) -> Any:
    if not isinstance(prompt, str):
        return prompt
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


@with_engine_options
def generate(
    prompt: list[str] | None = typer.Option(None, "--prompt", "-p",
                                            help="Prompt text; repeat for a batch (they run together)."),
    prompts_file: Path | None = typer.Option(
        None, "--prompts-file",
        help="One prompt per line ('-' = stdin); a .jsonl file holds strings or {\"prompt\"} / {\"messages\"}."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message and apply the "
                                                    "model's chat template."),
    system: str | None = typer.Option(None, "--system", help="System message for --chat."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object per prompt (no streaming)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate per prompt.",
                                       rich_help_panel=SAMPLING),
    temperature: float = typer.Option(0.0, "--temperature",
                                      help="0 = greedy (the default here); > 0 samples.", rich_help_panel=SAMPLING),
    top_p: float = typer.Option(1.0, "--top-p", rich_help_panel=SAMPLING),
    top_k: int = typer.Option(-1, "--top-k", help="-1 = off.", rich_help_panel=SAMPLING),
    min_p: float = typer.Option(0.0, "--min-p", rich_help_panel=SAMPLING),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", rich_help_panel=SAMPLING),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", rich_help_panel=SAMPLING),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", rich_help_panel=SAMPLING),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable); not included in the "
                                                               "output.", rich_help_panel=SAMPLING),
    stop_token_id: list[int] | None = typer.Option(None, "--stop-token-id", help="Stop token id (repeatable).",
                                                   rich_help_panel=SAMPLING),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past EOS.",
                                    rich_help_panel=SAMPLING),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed (same seed, same text).",
                                    rich_help_panel=SAMPLING),
    backend: Backend = typer.Option("sglx", "--backend", case_sensitive=False, rich_help_panel=DIFFUSION,
                                    help="Diffusion models: sglx's native pipeline, or diffusers' own pipeline "
                                         "(families sglx does not run natively; --attention-backend then takes "
                                         "diffusers' names)."),
    negative_prompt: str | None = typer.Option(None, "--negative-prompt", rich_help_panel=DIFFUSION,
                                               help="What to steer away from (classifier-free guidance)."),
    num_inference_steps: int | None = typer.Option(None, "--num-inference-steps", rich_help_panel=DIFFUSION,
                                                   help="Denoising steps (default: the model's)."),
    guidance_scale: float | None = typer.Option(None, "--guidance-scale", rich_help_panel=DIFFUSION,
                                                help="CFG scale; > 1 runs the conditional and unconditional "
                                                     "branches as one batch (default: the model's)."),
    true_cfg_scale: float | None = typer.Option(None, "--true-cfg-scale", rich_help_panel=DIFFUSION,
                                                help="FLUX: real classifier-free guidance against --negative-prompt "
                                                     "(diffusers' true_cfg_scale; > 1 turns it on). "
                                                     "--guidance-scale is FLUX-dev's distilled guidance."),
    height: int | None = typer.Option(None, "--height", rich_help_panel=DIFFUSION, help="Pixels (default: the "
                                                                                       "model's)."),
    width: int | None = typer.Option(None, "--width", rich_help_panel=DIFFUSION, help="Pixels (default: the "
                                                                                     "model's)."),
    num_frames: int | None = typer.Option(None, "--num-frames", rich_help_panel=DIFFUSION,
                                          help="Frames (Wan takes 4k+1; 1 = a still image)."),
    fps: int | None = typer.Option(None, "--fps", rich_help_panel=DIFFUSION, help="Frames per second of the "
                                                                                 "written video."),
    output: str | None = typer.Option(None, "--output", "-o", rich_help_panel=DIFFUSION,
                                      help="Output file for one prompt; the suffix picks the format: .png .jpg "
                                           ".webp (stills), .mp4 .gif (videos)."),
    output_dir: str | None = typer.Option(None, "--output-dir", rich_help_panel=DIFFUSION,
                                          help="Folder for one file per prompt (default: ./outputs)."),
    engine_config: EngineConfig = None,  # type: ignore[assignment]  # filled by @with_engine_options
) -> None:
    """Generate text (LLMs) or images and videos (diffusion models) for one or more prompts.

    The model decides: a diffusers directory (model_index.json) or `--model-path tiny-shapes` makes pictures;
    anything else is an LLM (default: the tiny key-value-recall model shipped with sglx).
    """
    from sglx.llm.sampling import SamplingParams

    diffusion = DiffusionFlags(Backend(backend).value, negative_prompt, num_inference_steps, guidance_scale,
                               true_cfg_scale, height, width, num_frames, fps, output, output_dir)
    try:
        prompts = _read_prompts(prompt, prompts_file)
        if is_diffusion_model(engine_config.model_path) or (diffusion.given() and engine_config.model_path):
            # Diffusion flags with a path that is no diffusion model: the loader says precisely why not.
            run_diffusion(engine_config, prompts, diffusion, seed, json_output)
            return
        diffusion.reject_for_llm()
        if chat:
            prompts = [_as_chat(p, system) for p in prompts]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, repetition_penalty=repetition_penalty,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                stop=tuple(stop or ()), stop_token_ids=tuple(stop_token_id or ()),
                                ignore_eos=ignore_eos, seed=seed)
        _run(engine_config, prompts, params, json_output)
    except SglxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _check_tokenizer(config: EngineConfig) -> None:
    """Text prompts need a tokenizer: say so before minutes of weight loading, not after."""
    if config.model_path is None or config.tokenizer_path:
        return
    from sglx.llm.model_config import load_model_config

    load_model_config(config.model_path)  # an unknown path gets its own, more precise error first
    if not (Path(config.model_path).expanduser() / "tokenizer.json").is_file():
        raise SglxError(
            f"--model-path {config.model_path} has no tokenizer.json, and sglx generate takes text prompts: "
            "give --tokenizer-path DIR (a directory with tokenizer.json), or time dummy-weight models with "
            "`sglx bench one-batch`"
        )


def _run(config: EngineConfig, prompts: list[Any], params: Any, json_output: bool) -> None:
    from sglx.llm.engine import Engine

    _check_tokenizer(config)
    with Engine(config) as engine:
        info = engine.info
        backends = {"prefill": info["prefill_attention_backend"], "decode": info["decode_attention_backend"],
                    "page_size": info["page_size"], "kv_cache_dtype": info["kv_cache_dtype"],
                    "selection": info["selection"], "cuda_graph": info["cuda_graph"],
                    "cuda_graph_why": info["cuda_graph_why"]}
        if json_output:
            results = engine.generate(prompts, params)
            for p, r in zip(prompts, results):  # type: ignore[arg-type]
                typer.echo(json.dumps({"prompt": p, **_public(r), "attention_backend": backends,
                                       "model_path": info["model_path"]}, ensure_ascii=False))
            return
        graphs = (f"CUDA graphs: bs <= {info['cuda_graph_max_bs']}" if info["cuda_graph"]
                  else f"CUDA graphs off ({info['cuda_graph_why']})")
        if info.get("prefill_cuda_graph"):
            graphs += f", 1-request prefill <= {info['prefill_cuda_graph_max_tokens']} tokens"
        typer.echo(f"[sglx] {info['model_path']} | attention: {info['attention_backend']} | "
                   f"page size {info['page_size']} | {info['device']} {info['dtype']} | {graphs}", err=True)
        streams = [engine.stream(p, params) for p in prompts]  # submitted together: one batch
        for i, (p, chunks) in enumerate(zip(prompts, streams)):
            if len(prompts) > 1:
                shown = p if isinstance(p, str) else p[-1].get("content", "")
                typer.echo(f"{'' if i == 0 else chr(10)}>>> {shown}")
            result: dict[str, Any] = {}
            for chunk in chunks:
                if chunk["text"]:
                    sys.stdout.write(chunk["text"])
                    sys.stdout.flush()
                result = chunk.get("result") or result
            sys.stdout.write("\n")
            if result.get("error"):
                typer.echo(f"[sglx] request ended early: {result['error']}", err=True)
            typer.echo(f"[sglx] {result.get('completion_tokens', 0)} tokens, finish_reason="
                       f"{result.get('finish_reason')}", err=True)


def _public(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("text", "output_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
            "matched_stop", "error", "e2e_latency")
    return {k: result.get(k) for k in keys}
