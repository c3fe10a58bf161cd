"""STA mask search: per (step, layer, head), the smallest window whose output stays close to dense attention.

As in the STA paper's search (FastVideo's STA_searching mode): while a few prompts are generated with dense
attention, every sparse step's attention is also computed under each candidate window, and the relative L2
error of each head's sparse output against the dense one is averaged over calls. The strategy keeps, for
each (step, layer, head), the window with the fewest tiles whose mean error is within the tolerance (the
largest candidate where none is), and is written in FastVideo's JSON format for `STA_inference`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sglx.attention.diffusion.sparse.sta_strategy import Window

DEFAULT_CANDIDATES: tuple[Window, ...] = ((1, 3, 3), (3, 3, 3), (3, 3, 5), (3, 5, 5), (3, 5, 7), (5, 5, 7))
DEFAULT_TOLERANCE = 0.05  # mean relative L2 error of a head's output vs dense attention


def clamp_window(window: Window, tiles: tuple[int, int, int]) -> Window:
    return tuple(min(w, n) for w, n in zip(window, tiles))  # type: ignore[return-value]


def head_errors(sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per head: [B, S, H, D] pair -> [H] (float64, on the CPU)."""
    diff = (sparse.double() - dense.double()).pow(2).sum(dim=(0, 1, 3))
    norm = dense.double().pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-30)
    return (diff / norm).sqrt().cpu()


@dataclass
class SearchRecord:
    """Sums of per-head errors per (step, layer, head) and window; `calls` counts the averaged calls."""

    sums: dict[tuple[int, int, int], dict[Window, float]] = field(default_factory=lambda: defaultdict(dict))
    calls: dict[tuple[int, int, int], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, step: int, layer: int, window: Window, errors: torch.Tensor, first_window: bool) -> None:
        for head, err in enumerate(errors.tolist()):
            key = (step, layer, head)
            if first_window:
                self.calls[key] += 1
            self.sums[key][window] = self.sums[key].get(window, 0.0) + err

    def strategy(self, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, list[int]]:
        """FastVideo JSON: the window with the fewest tiles within `tolerance` for every recorded head."""
        out: dict[str, list[int]] = {}
        for key in sorted(self.sums):
            means = {w: s / max(self.calls[key], 1) for w, s in self.sums[key].items()}
            by_size = sorted(means, key=lambda w: (w[0] * w[1] * w[2], w))
            within = [w for w in by_size if means[w] <= tolerance]
            out["_".join(map(str, key))] = list(within[0] if within else by_size[-1])
        return out

    def write(self, path: str | Path, tolerance: float = DEFAULT_TOLERANCE) -> Path:
        file = Path(path)
        file.write_text(json.dumps(self.strategy(tolerance), indent=1))
        return file
