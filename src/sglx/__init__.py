"""sglx: run LLMs and diffusion models fast, built around attention backends."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
