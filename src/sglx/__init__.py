"""sglx: run LLMs and diffusion models fast, built around attention backends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from sglx.llm.engine import Engine
    from sglx.llm.sampling import SamplingParams

_LAZY = {"Engine": "sglx.llm.engine", "SamplingParams": "sglx.llm.sampling"}


def __getattr__(name: str) -> Any:
    """`sglx.Engine` imports torch and the runtime only when first used, so `import sglx` stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sglx' has no attribute {name!r}")
