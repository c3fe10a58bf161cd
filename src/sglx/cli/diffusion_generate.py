"""`sglx generate` for diffusion models: flag handling and the progress display; the work is DiffusionEngine's."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import typer

from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig


def is_diffusion_model(model_path: str | None) -> bool:
    from sglx.diffusion.engine import resolve_diffusion_model_path

    return resolve_diffusion_model_path(model_path) is not None


@dataclass(frozen=True)
class DiffusionFlags:
    """The diffusion-only flags of `sglx generate`, as given (None = the model's default)."""

    backend: str = "sglx"
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    output: str | None = None
    output_dir: str | None = None

    def given(self) -> list[str]:
        out = ["--backend"] if self.backend != "sglx" else []
        return out + ["--" + f.name.replace("_", "-") for f in fields(self)
                      if f.name != "backend" and getattr(self, f.name) is not None]

    def reject_for_llm(self) -> None:
        given = self.given()
        if given:
            raise SglxError(f"{', '.join(given)} only apply to diffusion models; this is an LLM. Give a diffusion "
                            "model with --model-path (a diffusers directory, or tiny-shapes)")


def _progress_factory(console: Any, progress: Any) -> Any:
    def for_prompt(index: int, prompt: str) -> Any:
        task = progress.add_task(f"[{index}] {prompt[:40]}", total=None)

        def step(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return step

    return for_prompt


def run_diffusion(config: EngineConfig, prompts: list[Any], flags: DiffusionFlags, seed: int | None,
                  json_output: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sglx.diffusion.batch_job import OutputPlan, run_prompts
    from sglx.diffusion.engine import DiffusionEngine
    from sglx.diffusion.parallel.launch import join_torchrun, launch_ranks, needs_launch
    from sglx.diffusion.request import DiffusionRequest

    if any(not isinstance(p, str) for p in prompts):
        raise SglxError("diffusion models take text prompts; chat messages (--chat, {\"messages\"}) are for LLMs")
    plan = OutputPlan.from_flags(flags.output, flags.output_dir, len(prompts), flags.num_frames)
    if needs_launch(config):  # --sp-size N: N processes each run this function; rank 0 prints and writes
        launch_ranks(run_diffusion, config, prompts, flags, seed, json_output, backend=flags.backend)
        return
    join_torchrun(config)  # a rank torchrun started: join its group (no-op otherwise)
    requests = [DiffusionRequest(prompt=p, negative_prompt=flags.negative_prompt, height=flags.height,
                                 width=flags.width, num_frames=flags.num_frames,
                                 num_inference_steps=flags.num_inference_steps, guidance_scale=flags.guidance_scale,
                                 true_cfg_scale=flags.true_cfg_scale, fps=flags.fps, seed=seed) for p in prompts]
    console = Console(stderr=True)
    with DiffusionEngine(config, backend=flags.backend) as engine:
        info = engine.info
        quiet = json_output or not engine.is_driver
        if not quiet:
            console.print(f"[sglx] {info['model_path']} ({info['pipeline']}, --backend {info['backend']}) | "
                          f"attention: {info['attention_backend']} ({info['attention_source']}) | "
                          f"{info['device']} {info['dtype']}"
                          + (f" | {info['sequence_parallel']}" if info.get("sequence_parallel") else ""),
                          highlight=False, markup=False, soft_wrap=True)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True, disable=quiet) as progress:
            for record in run_prompts(engine, requests, plan, _progress_factory(console, progress)):
                if json_output:
                    typer.echo(json.dumps(record, ensure_ascii=False))
                else:
                    t = record["timings"]
                    console.print(f"[sglx] wrote {record['path']} ({record['num_frames']}x{record['height']}x"
                                  f"{record['width']}, seed {record['seed']}) in {t['total_s']:.2f} s: text "
                                  f"{t['text_encode_s']:.2f} s, denoise {t['denoise_s']:.2f} s, VAE "
                                  f"{t['vae_decode_s']:.2f} s", highlight=False, markup=False, soft_wrap=True)
