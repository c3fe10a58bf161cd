"""The triton MLA backend and its split-KV latent decode kernel, on CPU through the Triton interpreter.

The cases (tests/triton_interpreted/mla_cases.py) run in a child pytest with TRITON_INTERPRET=1, which must
be set before the kernels are defined and must not leak into this process.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_mla_matches_float64_under_the_interpreter():
    run_interpreted("mla_cases.py")
