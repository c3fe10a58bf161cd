"""`sglx generate` for diffusion models: where each prompt's file goes, and running them one by one."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglx.diffusion.output import check_output_path, default_suffix, write_frames
from sglx.diffusion.request import DiffusionRequest, DiffusionResult
from sglx.errors import SglxError

DEFAULT_OUTPUT_DIR = "outputs"


@dataclass(frozen=True)
class OutputPlan:
    """--output (one prompt, one file) or --output-dir (a file per prompt, named from the prompt and seed)."""

    output: Path | None = None
    output_dir: Path | None = None

    @classmethod
    def from_flags(cls, output: str | None, output_dir: str | None, num_prompts: int,
                   num_frames: int | None) -> OutputPlan:
        if output is not None and output_dir is not None:
            raise SglxError("give --output FILE (one prompt) or --output-dir DIR (any number), not both")
        if output is not None:
            if num_prompts > 1:
                raise SglxError(f"--output names one file but there are {num_prompts} prompts; use --output-dir DIR")
            return cls(output=check_output_path(output, num_frames))
        folder = Path(output_dir or DEFAULT_OUTPUT_DIR).expanduser()
        if folder.exists() and not folder.is_dir():
            raise SglxError(f"--output-dir {folder} exists and is not a directory")
        return cls(output_dir=folder)

    def path_for(self, index: int, result: DiffusionResult) -> Path:
        if self.output is not None:
            return self.output
        assert self.output_dir is not None
        req = result.request
        slug = re.sub(r"[^a-z0-9]+", "_", req.prompt.lower()).strip("_")[:60] or "prompt"
        return self.output_dir / f"{index:03d}_{slug}_seed{req.seed}{default_suffix(result.frames.shape[0])}"


def result_record(result: DiffusionResult, path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The JSON line `sglx generate --json` prints for one prompt."""
    req = result.request
    return {"prompt": req.prompt, "path": str(path), "seed": req.seed, "num_frames": int(result.frames.shape[0]),
            "height": req.height, "width": req.width, "fps": req.fps, "num_inference_steps": req.num_inference_steps,
            "guidance_scale": req.guidance_scale, "true_cfg_scale": req.true_cfg_scale,
            "negative_prompt": req.negative_prompt,
            "attention_backend": result.attention_backend, "backend": info["backend"],
            "model_path": info["model_path"], "device": info["device"], "dtype": info["dtype"],
            "sequence_parallel": info.get("sequence_parallel"),
            "timings": result.timings.to_dict()}


def run_prompts(engine: Any, requests: list[DiffusionRequest], plan: OutputPlan,
                progress: Callable[[int, str], Callable[[int, int], None]] | None = None
                ) -> Iterator[dict[str, Any]]:
    """Generate and write each request in turn; every request is validated before the first one runs."""
    for req in requests:
        engine.resolve(req)
    for i, req in enumerate(requests):
        step_fn = progress(i, req.prompt) if progress is not None else None
        result = engine.generate(req, step_fn)
        if not getattr(engine, "is_driver", True):  # sequence parallel: rank 0 writes, the other ranks only compute
            continue
        path = write_frames(result.frames, plan.path_for(i, result), result.request.fps)
        yield result_record(result, path, engine.info)
