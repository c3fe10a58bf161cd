"""Per-step facts of a DiT forward pass: the diffusion twin of the LLM side's ForwardBatch.

The pipeline builds one `DiTAttnMetadata` per denoising step and every DiT attention layer and every
backend reads it. Sparse backends (tiles, cubes, chunks, clusters) need exactly these facts and nothing
else: where the latent tokens sit in the sequence, their (T, H, W) grid, where the text tokens sit, and
which step of how many is running.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

TextPosition = Literal["none", "prefix", "suffix"]


@dataclass(frozen=True)
class DiTAttnMetadata:
    """One denoising step of one DiT: token layout, step position and attention shape.

    The self-attention sequence is `text_tokens` text tokens before (`prefix`, FLUX / MM-DiT) or after
    (`suffix`) the `T*H*W` latent tokens, or the latent tokens alone (`none`, Wan: text enters through
    cross-attention). Latent tokens are in row-major (t, h, w) order, as patchify leaves them.
    """

    grid: tuple[int, int, int]  # latent token grid (T, H, W) after patchify
    num_heads: int
    head_dim: int
    text_tokens: int = 0
    text_position: TextPosition = "none"
    step_index: int = 0  # 0-based denoising step
    num_steps: int = 1
    timestep: float | None = None  # the scheduler's timestep value at this step
    batch_size: int = 1  # rows in the DiT batch (CFG doubles it)
    cfg: bool = False  # rows [0, B/2) are conditional, [B/2, B) unconditional
    num_layers: int | None = None
    head_offset: int = 0  # global index of the first head in q: Ulysses hands each rank a slice of the heads

    def __post_init__(self) -> None:
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"grid must be three positive sizes (T, H, W); got {self.grid}")
        if self.text_tokens < 0:
            raise ValueError(f"text_tokens must be >= 0; got {self.text_tokens}")
        if (self.text_tokens == 0) != (self.text_position == "none"):
            raise ValueError(f"text_position {self.text_position!r} does not match {self.text_tokens} text tokens")
        if not 0 <= self.step_index < max(self.num_steps, 1):
            raise ValueError(f"step_index {self.step_index} is outside 0..{self.num_steps - 1}")

    @property
    def image_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def seq_len(self) -> int:
        """Length of the self-attention sequence (latent plus joint text tokens)."""
        return self.image_tokens + self.text_tokens

    @property
    def image_start(self) -> int:
        """Index of the first latent token in the self-attention sequence."""
        return self.text_tokens if self.text_position == "prefix" else 0

    @property
    def text_start(self) -> int:
        return 0 if self.text_position == "prefix" else self.image_tokens

    def at_step(self, step_index: int, timestep: float | None = None) -> DiTAttnMetadata:
        return replace(self, step_index=step_index, timestep=timestep)


_CURRENT: contextvars.ContextVar[DiTAttnMetadata | None] = contextvars.ContextVar("sglx_dit_metadata", default=None)


@contextlib.contextmanager
def dit_step(meta: DiTAttnMetadata) -> Iterator[DiTAttnMetadata]:
    """Make `meta` the metadata every DiT attention layer sees during one forward pass."""
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def current_metadata() -> DiTAttnMetadata | None:
    """The metadata of the forward pass in progress; None outside a pipeline step (plain module calls)."""
    return _CURRENT.get()
