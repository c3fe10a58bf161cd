"""sglx's Triton kernels against float64, on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before any kernel is defined, and must not leak into other tests of
this pytest process, so the cases (tests/triton_interpreted/kernel_cases.py) run in a child pytest.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_float64_under_the_interpreter():
    run_interpreted("kernel_cases.py")
