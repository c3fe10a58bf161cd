"""How sparse a whole generation really ran: the block density of every sparse self-attention call.

A sparse backend runs dense in its warm-up steps and layers, and a config can keep every block pair on a small
grid (a tile as large as the grid, a top-k as large as the block count): then a quality number says nothing
about the sparse path. The recorder wraps one backend instance's `forward` and reads the layout its plan chose
(`last_layout`, set by every sparse call) after each self-attention call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class DensityRecorder:
    """Per-call densities of `backend` (the instance a pipeline calls; a dense backend records no sparse call)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls = 0  # self-attention calls seen (with step metadata)
        self.densities: list[float] = []  # one per call that ran block-sparse

    @contextlib.contextmanager
    def recording(self, active: bool = True) -> Iterator[None]:
        """Record the calls made inside the block (nothing when `active` is False)."""
        if not active or not hasattr(self.backend, "last_layout"):
            yield
            return
        inner = self.backend.forward

        def forward(q: Any, k: Any, v: Any, *, scale: float | None = None, meta: Any = None,
                    layer: int = 0) -> Any:
            self.backend.last_layout = None
            out = inner(q, k, v, scale=scale, meta=meta, layer=layer)
            if meta is not None:
                self.calls += 1
                layout = self.backend.last_layout
                if layout is not None:
                    self.densities.append(layout.density())
            return out

        self.backend.forward = forward
        try:
            yield
        finally:
            del self.backend.forward  # the class's method again

    def summary(self) -> dict[str, Any] | None:
        """None for a backend without block-sparse plans; else calls, sparse calls and their density."""
        if not hasattr(self.backend, "last_layout"):
            return None
        d = self.densities
        out: dict[str, Any] = {"calls": self.calls, "sparse_calls": len(d)}
        if d:
            out.update(mean=sum(d) / len(d), min=min(d), max=max(d), all_dense=min(d) >= 1.0)
        return out


__all__ = ["DensityRecorder"]
