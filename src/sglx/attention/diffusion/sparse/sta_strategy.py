"""STA mask strategies in FastVideo's JSON format: `{"<step>_<layer>_<head>": [wt, wh, ww], ...}`.

Each value is the window of one head of one DiT layer at one denoising step, counted in tiles along
(T, H, W): a query tile attends the wt x wh x ww key tiles around it (the window slides inside the grid, so
edge tiles see as many tiles as the middle ones). FastVideo's mask search writes such files and users can
reuse theirs. Steps past the file's last step use the windows of its last step, so a file written for one
step (such as `uniform_strategy`'s) serves every step; a layer or head the file lacks is an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglx.errors import ConfigError

Window = tuple[int, int, int]
KEY = "mask_strategy_file_path"


@dataclass(frozen=True)
class MaskStrategy:
    """Windows per (step, layer, head); `source` names the file in errors."""

    windows: Mapping[tuple[int, int, int], Window]
    source: str = "<strategy>"

    def steps(self) -> list[int]:
        return sorted({s for s, _, _ in self.windows})

    def layer_windows(self, step: int, layer: int, num_heads: int) -> tuple[Window, ...]:
        """The windows of every head of `layer` at `step` (the file's last step at or before it)."""
        present = [s for s in self.steps() if s <= step]
        if not present:
            raise ConfigError(f"mask strategy {self.source} has no windows for step {step} (its first step is "
                              f"{self.steps()[0]}); add keys '{step}_<layer>_<head>' or raise skip_time_steps",
                              KEY)
        use = present[-1]
        out = []
        for head in range(num_heads):
            window = self.windows.get((use, layer, head))
            if window is None:
                raise ConfigError(f"mask strategy {self.source} has no key '{use}_{layer}_{head}' (step {use}, "
                                  f"layer {layer}, head {head}); the model has {num_heads} heads per layer", KEY)
            out.append(window)
        return tuple(out)


def parse_strategy(data: object, source: str = "<strategy>") -> MaskStrategy:
    """Validate a decoded JSON object: every key `int_int_int`, every value three positive ints."""
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"mask strategy {source} must be a non-empty JSON object of "
                          "'<step>_<layer>_<head>': [wt, wh, ww] entries", KEY)
    windows: dict[tuple[int, int, int], Window] = {}
    for key, value in data.items():
        parts = str(key).split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ConfigError(f"mask strategy {source}: key {key!r} is not '<step>_<layer>_<head>' "
                              "(three non-negative integers)", KEY)
        step, layer, head = map(int, parts)
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f"mask strategy {source}: key {key!r} (layer {layer}, head {head}) must be a window "
                              f"[wt, wh, ww] of three positive integers in tiles; got {value!r}", KEY)
        windows[(step, layer, head)] = (value[0], value[1], value[2])
    return MaskStrategy(windows, source)


def load_strategy(path: str | Path) -> MaskStrategy:
    """Read and validate a mask strategy file; every problem is one ConfigError naming the file and key."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"mask strategy file {file} does not exist; write one with "
                          "sglx.attention.diffusion.sparse.sta_strategy.write_uniform_strategy", KEY)
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"mask strategy file {file} is not valid JSON: {exc}", KEY) from exc
    return parse_strategy(data, str(file))


def uniform_strategy(num_layers: int, num_heads: int, window: Window = (3, 3, 3), step: int = 0
                     ) -> dict[str, list[int]]:
    """One window for every head of every layer, as FastVideo JSON (keys for `step`; later steps reuse it)."""
    if num_layers < 1 or num_heads < 1 or len(window) != 3 or min(window) < 1:
        raise ValueError(f"need layers, heads >= 1 and a window of three positive ints; got {num_layers}, "
                         f"{num_heads}, {window}")
    return {f"{step}_{layer}_{head}": list(window) for layer in range(num_layers) for head in range(num_heads)}


def write_uniform_strategy(path: str | Path, num_layers: int, num_heads: int, window: Window = (3, 3, 3)) -> Path:
    """Write `uniform_strategy` to `path` (for --attention-backend-config mask_strategy_file_path=...)."""
    file = Path(path)
    file.write_text(json.dumps(uniform_strategy(num_layers, num_heads, window), indent=1))
    return file


def main(argv: list[str] | None = None) -> int:
    """`python -m sglx.attention.diffusion.sparse.sta_strategy OUT --layers 30 --heads 12 --window 3,3,3`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sglx.attention.diffusion.sparse.sta_strategy",
                                 description="Write a uniform STA mask strategy (FastVideo JSON) for "
                                             "--attention-backend-config mask_strategy_file_path=OUT.")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True, help="DiT blocks (Wan2.1-1.3B: 30)")
    ap.add_argument("--heads", type=int, required=True, help="attention heads per block (Wan2.1-1.3B: 12)")
    ap.add_argument("--window", default="3,3,3", help="wt,wh,ww in 6x8x8-token tiles (default 3,3,3)")
    args = ap.parse_args(argv)
    try:
        window = tuple(int(x) for x in args.window.split(","))
        if len(window) != 3:
            raise ValueError
    except ValueError:
        ap.error(f"--window {args.window!r}: give three integers, e.g. 3,3,3")
    try:
        path = write_uniform_strategy(args.out, args.layers, args.heads, window)  # type: ignore[arg-type]
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
