#!/usr/bin/env python3
"""Judge the tiny-shapes model with the pixel checker: every prompt through sglx's DiffusionEngine.

    python scripts/eval_tiny_shapes.py                      # shipped model, its defaults, CPU
    python scripts/eval_tiny_shapes.py --model-path /tmp/tiny-shapes --device cuda --grid 8,12,16 --guidance 3,4,5
    python scripts/eval_tiny_shapes.py --threads 2 --attention-backend video_sparse_attn \
        --attention-backend-config sparsity=0.5

Prints, per (steps, guidance): the share of attributes judged right over the 48 moving prompts (colour,
shape, direction) and over the 12 still prompts at one frame (colour, shape), the median seconds per
clip, and for a sparse backend the block density its plans reported (mean, min, max over the sparse
calls of the moving clips) and the share of self-attention calls that ran sparse (warm-up steps and
layers run dense). A sparse backend whose plans all attended every block pair is reported as dense.
--json writes every judgement.

tiny-shapes' latent grid is 5x8x8 (320 tokens): FastVideo's 6x8x8 STA tile covers it whole (one tile,
always dense), so `--sta-tile 1,4,4` (an experiment knob of this script, not a backend config key) sets
sliding_tile_attn's tile for the run; the mask strategy's windows count these tiles (5x2x2 of them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sglx.attention.diffusion.sparse.density import DensityRecorder
from sglx.diffusion.embedded import shapes_task as task
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.request import DiffusionRequest
from sglx.llm.engine_config import EngineConfig

# every shape, colour and direction, each prompt once (the subset tests/test_tiny_shapes.py judged until session 9)
SUBSET = (0, 5, 10, 15, 17, 22, 27, 28, 36, 41, 46, 47)


def evaluate(engine: DiffusionEngine, steps: int | None, guidance: float | None, seed: int,
             motion: list | None = None, still: list | None = None) -> dict:
    """Judge `motion` (default: all 48) at the model's frame count and `still` (default: all 12) at one frame."""
    rows, seconds = [], []
    motion = task.motion_specs() if motion is None else motion
    still = task.still_specs() if still is None else still
    cases = [(s, None) for s in motion] + [(s, 1) for s in still]
    recorder = DensityRecorder(getattr(engine.pipeline, "backend", None))
    for spec, frames in cases:
        t = time.perf_counter()
        with recorder.recording(frames is None):  # densities of the video clips (a still frame is one latent frame)
            res = engine.generate(DiffusionRequest(prompt=spec.prompt, num_frames=frames,
                                                   num_inference_steps=steps, guidance_scale=guidance, seed=seed))
        if frames is None:
            seconds.append(time.perf_counter() - t)
        j = task.judge(res.frames)
        rows.append({"prompt": spec.prompt, "frames": int(res.frames.shape[0]), "judged": j.__dict__,
                     "right": task.score(spec, j, res.frames.shape[0])})
    moving_ok = [v for r in rows if r["frames"] > 1 for v in r["right"].values()]
    still_ok = [v for r in rows if r["frames"] == 1 for v in r["right"].values()]
    per_attribute = {a: sum(r["right"][a] for r in rows if r["frames"] > 1) for a in ("colour", "shape", "direction")}
    return {"steps": steps, "guidance": guidance, "moving_acc": sum(moving_ok) / max(len(moving_ok), 1),
            "moving_right": per_attribute, "moving_prompts": len(motion),
            "still_acc": sum(still_ok) / len(still_ok) if still_ok else None,
            "median_s": statistics.median(seconds) if seconds else None, "density": recorder.summary(),
            "rows": rows}


def density_text(density: dict | None) -> str:
    if density is None:
        return ""
    if density["sparse_calls"] == 0:
        return "  density: no sparse call (dense throughout)"
    return (f"  density mean {density['mean']:.3f} (min {density['min']:.3f}, max {density['max']:.3f}) over "
            f"{density['sparse_calls']}/{density['calls']} self-attention calls")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-shapes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--attention-backend-config", default=None, help="the backend's config: file, JSON or k=v pairs")
    p.add_argument("--sta-tile", default="", help="sliding_tile_attn tile T,H,W (default 6,8,8)")
    p.add_argument("--prompts", default="", help="judge only these moving prompts (comma-separated indices into the "
                                                 "48; `subset`: the 12 of tests/test_tiny_shapes.py), no still ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", default="", help="comma-separated step counts (default: the model's)")
    p.add_argument("--guidance", default="", help="comma-separated guidance scales (default: the model's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--json", default="", help="write every judgement here")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.sta_tile:
        from sglx.attention.diffusion.sparse.sliding_tile import SlidingTileAttentionBackend

        SlidingTileAttentionBackend.default_tile = tuple(int(x) for x in args.sta_tile.split(","))  # type: ignore[misc]
    engine = DiffusionEngine(EngineConfig(model_path=args.model_path, device=args.device, dtype="float32",
                                          attention_backend=args.attention_backend,
                                          attention_backend_config=args.attention_backend_config))
    indices = SUBSET if args.prompts == "subset" else [int(i) for i in args.prompts.split(",") if i]
    motion = [task.motion_specs()[i] for i in indices] if indices else None
    steps = [int(s) for s in args.grid.split(",") if s] or [None]
    scales = [float(g) for g in args.guidance.split(",") if g] or [None]
    results = []
    for n in steps:
        for g in scales:
            r = evaluate(engine, n, g, args.seed, motion, [] if args.prompts else None)
            r["attention_backend"], r["attention_backend_config"] = engine.attention.name, engine.attention.config
            results.append(r)
            total = r["moving_prompts"]
            still = f"still {r['still_acc']:.3f}  " if r["still_acc"] is not None else ""
            print(f"steps {n or engine.defaults.num_inference_steps:3d} guidance "
                  f"{g if g is not None else engine.defaults.guidance_scale:4.1f}  moving {r['moving_acc']:.3f}  "
                  f"({', '.join(f'{a} {k}/{total}' for a, k in r['moving_right'].items())})  "
                  f"{still}median {r['median_s']:.2f} s/clip  [{engine.attention.name}]{density_text(r['density'])}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
