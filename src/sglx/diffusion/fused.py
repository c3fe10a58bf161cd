"""The switch of sglx's fused DiT kernels (q/k prologue, norm + modulation, gated residual).

On by default on CUDA; SGLX_DIT_FUSED=0 (or `fused_kernels(False)`) runs diffusers' torch arithmetic
instead, which is what CPU always runs and what benchmarks A/B against in one run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV_SWITCH = "SGLX_DIT_FUSED"
_ENABLED = [os.environ.get(ENV_SWITCH, "1") != "0"]
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Turn the fused kernels on or off inside a block."""
    previous = _ENABLED[0]
    _ENABLED[0] = enabled
    try:
        yield
    finally:
        _ENABLED[0] = previous


def use_fused(x: torch.Tensor) -> bool:
    """A CUDA fp16/bf16 tensor with unit inner stride, the switch on, and Triton importable."""
    if not (_ENABLED[0] and x.is_cuda and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
