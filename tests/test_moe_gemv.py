"""One token's MoE experts as GEMVs (sglx.llm.kernels.moe_gemv): its interpreted Triton cases run in a child pytest
(TRITON_INTERPRET=1 must be set before triton is imported)."""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_moe_gemv_cases_under_the_interpreter():
    run_interpreted("moe_gemv_cases.py")
