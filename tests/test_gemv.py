"""The one-row GEMV (sglx.llm.kernels.gemv): its interpreted Triton cases run in a child pytest (TRITON_INTERPRET=1
must be set before triton is imported), and the CPU path of `RMSNorm.norm_linear` is the norm, then the product."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from sglx.llm.layers.norm import RMSNorm
from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemv_cases_under_the_interpreter():
    run_interpreted("gemv_cases.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_gemv_cases_under_the_interpreter():
    run_interpreted("gemv_fused_cases.py")


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_on_cpu_is_the_norm_then_the_product(with_residual):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32, generator=gen) + 0.5
    x, r = torch.randn(1, 32, generator=gen), torch.randn(1, 32, generator=gen)
    w, b = torch.randn(8, 32, generator=gen), torch.randn(8, generator=gen)
    residual = r if with_residual else None
    y, updated = norm.norm_linear(x, residual, w, b)
    stream = r + x if with_residual else x
    assert torch.equal(updated, stream)
    assert torch.equal(y, F.linear(norm(stream), w, b))
