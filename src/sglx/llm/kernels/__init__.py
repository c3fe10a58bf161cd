"""Fused Triton kernels for the LLM layers (RMSNorm with residual add, rotary, SiLU-and-mul).

Why: a decode step of a small batch is a few GEMVs plus hundreds of tiny element-wise kernels; even
inside a CUDA graph each costs a few microseconds of GPU time, so fusing them is what brings the
step towards the memory floor. The layers call `use_fused(tensor)` and take the fused path only for
CUDA (or ROCm) tensors when triton imports; CPU tensors always run the plain torch code, so CPU
results (and the Hugging Face parity tests) are unchanged.

The kernel modules import triton at their top: import them only after `use_fused` said yes (or
under TRITON_INTERPRET=1 in tests). `SGLX_FUSED_KERNELS=0` turns the fused path off for a process;
`fused_kernels(False)` does so for a block (tests compare both paths in one process).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV_SWITCH = "SGLX_FUSED_KERNELS"


def env_switch(name: str) -> bool:
    """An on-by-default switch from the environment: off for 0 / false / off / no (any case, spaces ignored)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


_enabled = env_switch(ENV_SWITCH)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_kernels_enabled() -> bool:
    return _enabled


def use_fused(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA/ROCm device, triton is installed and the switch is on."""
    return t.is_cuda and _enabled and triton_available()


@contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Turn the fused path on or off inside the block (models captured in CUDA graphs keep what they captured)."""
    global _enabled
    previous = _enabled
    _enabled = enabled
    try:
        yield
    finally:
        _enabled = previous


__all__ = ["ENV_SWITCH", "fused_kernels", "fused_kernels_enabled", "triton_available", "use_fused"]
