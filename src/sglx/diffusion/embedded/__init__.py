"""Diffusion models shipped inside sglx, so `sglx generate --model-path tiny-shapes` needs no download."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent
TINY_SHAPES = "tiny-shapes"


def embedded_diffusion_models() -> dict[str, Path]:
    """Name -> directory of every shipped diffusion model that is present in this install."""
    return {p.name: p for p in sorted(EMBEDDED_DIR.iterdir()) if (p / "model_index.json").is_file()}


def resolve_embedded(name: str) -> Path | None:
    return embedded_diffusion_models().get(name)
