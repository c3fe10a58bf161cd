#!/usr/bin/env python3
"""Judge the tiny-shapes model with the pixel checker: every prompt through sglx's DiffusionEngine.

    python scripts/eval_tiny_shapes.py                      # shipped model, its defaults, CPU
    python scripts/eval_tiny_shapes.py --model-path /tmp/tiny-shapes --device cuda --grid 8,12,16 --guidance 3,4,5

Prints, per (steps, guidance): the share of attributes judged right over the 48 moving prompts (colour,
shape, direction) and over the 12 still prompts at one frame (colour, shape), and the median seconds
per clip. --json writes every judgement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sglx.diffusion.embedded import shapes_task as task
from sglx.diffusion.engine import DiffusionEngine
from sglx.diffusion.request import DiffusionRequest
from sglx.llm.engine_config import EngineConfig


def evaluate(engine: DiffusionEngine, steps: int | None, guidance: float | None, seed: int) -> dict:
    rows, seconds = [], []
    cases = [(s, None) for s in task.motion_specs()] + [(s, 1) for s in task.still_specs()]
    for spec, frames in cases:
        t = time.perf_counter()
        res = engine.generate(DiffusionRequest(prompt=spec.prompt, num_frames=frames, num_inference_steps=steps,
                                               guidance_scale=guidance, seed=seed))
        if frames is None:
            seconds.append(time.perf_counter() - t)
        j = task.judge(res.frames)
        rows.append({"prompt": spec.prompt, "frames": int(res.frames.shape[0]), "judged": j.__dict__,
                     "right": task.score(spec, j, res.frames.shape[0])})
    moving = [v for r in rows if r["frames"] > 1 for v in r["right"].values()]
    still = [v for r in rows if r["frames"] == 1 for v in r["right"].values()]
    per_attribute = {a: sum(r["right"][a] for r in rows if r["frames"] > 1) for a in ("colour", "shape", "direction")}
    return {"steps": steps, "guidance": guidance, "moving_acc": sum(moving) / len(moving),
            "moving_right": per_attribute, "still_acc": sum(still) / len(still),
            "median_s": statistics.median(seconds), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny-shapes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", default="", help="comma-separated step counts (default: the model's)")
    p.add_argument("--guidance", default="", help="comma-separated guidance scales (default: the model's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--json", default="", help="write every judgement here")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = DiffusionEngine(EngineConfig(model_path=args.model_path, device=args.device, dtype="float32",
                                          attention_backend=args.attention_backend))
    steps = [int(s) for s in args.grid.split(",") if s] or [None]
    scales = [float(g) for g in args.guidance.split(",") if g] or [None]
    results = []
    for n in steps:
        for g in scales:
            r = evaluate(engine, n, g, args.seed)
            results.append(r)
            print(f"steps {n or engine.defaults.num_inference_steps:3d} guidance "
                  f"{g if g is not None else engine.defaults.guidance_scale:4.1f}  moving {r['moving_acc']:.3f}  "
                  f"({', '.join(f'{a} {n}/48' for a, n in r['moving_right'].items())})  "
                  f"still {r['still_acc']:.3f}  median {r['median_s']:.2f} s/clip  [{engine.attention.name}]",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
