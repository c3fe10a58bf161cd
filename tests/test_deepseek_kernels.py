"""The fused Triton MoE kernels on CPU through the Triton interpreter (cases: tests/triton_interpreted/moe_cases.py)."""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_moe_matches_float64_under_the_interpreter():
    run_interpreted("moe_cases.py")
