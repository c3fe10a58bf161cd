"""Guarded import of an optional kernel function (flash_attn.cute, flash_attn_interface, ...).

Kernel packages are imported only when a backend is built, never at `import sglx`, and a package that
is installed but broken (missing CUDA libraries, an ABI mismatch) must surface as one line a user can
act on, not a traceback: hence ImportError, OSError, RuntimeError and AttributeError all become a
BackendUnavailableError naming the module and what to use instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from sglx.errors import BackendUnavailableError

IMPORT_FAILURES = (ImportError, OSError, RuntimeError, AttributeError)


def load_kernel(modules: str | tuple[str, ...], attr: str, backend: str, instead: str) -> Callable[..., Any]:
    """`attr` of the first of `modules` that imports, else one BackendUnavailableError naming every failure."""
    failures = []
    for module in (modules,) if isinstance(modules, str) else modules:
        try:
            return getattr(importlib.import_module(module), attr)
        except IMPORT_FAILURES as exc:
            failures.append((module, exc))
    what = "; ".join(f"{m} failed to import ({type(e).__name__}: {e})" for m, e in failures)
    raise BackendUnavailableError(f"attention backend {backend}: {what}; use {instead}") from failures[-1][1]
