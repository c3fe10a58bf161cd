"""DeepSeek's fused Triton kernels (MoE experts, MLA rotary) on CPU through the Triton interpreter.

Cases: tests/triton_interpreted/moe_cases.py and mla_rotary_cases.py (child pytest with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_fused_moe_matches_float64_under_the_interpreter():
    run_interpreted("moe_cases.py")


@needs_triton
def test_mla_rotary_equals_the_torch_path_under_the_interpreter():
    run_interpreted("mla_rotary_cases.py")
