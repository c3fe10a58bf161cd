"""Fused layer kernels (sglx.llm.kernels) and the switch that keeps CPU on the torch path.

The kernel cases (tests/triton_interpreted/fused_layer_cases.py) run in a child pytest with
TRITON_INTERPRET=1, which must be set before triton is imported and must not leak into this process.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

import sglx.llm.kernels as kernels
from sglx.llm.layers.norm import RMSNorm
from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_kernels_match_the_torch_path_under_the_interpreter():
    run_interpreted("fused_layer_cases.py")


def test_cpu_tensors_never_take_the_fused_path():
    x = torch.zeros(2, 8)
    with kernels.fused_kernels(True):
        assert kernels.fused_kernels_enabled()
        assert not kernels.use_fused(x)
    with kernels.fused_kernels(False):
        assert not kernels.fused_kernels_enabled()
    assert kernels.fused_kernels_enabled() is True  # the default, restored after the blocks


def test_the_environment_switch_turns_the_fused_path_off(monkeypatch: pytest.MonkeyPatch):
    try:
        monkeypatch.setenv(kernels.ENV_SWITCH, "0")
        assert importlib.reload(kernels).fused_kernels_enabled() is False
        monkeypatch.setenv(kernels.ENV_SWITCH, "1")
        assert importlib.reload(kernels).fused_kernels_enabled() is True
    finally:
        monkeypatch.delenv(kernels.ENV_SWITCH)
        importlib.reload(kernels)


def test_add_and_norm_on_cpu_is_the_residual_add_then_the_norm():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
    norm = norm.to(torch.bfloat16)
    delta = torch.randn(4, 32, generator=gen).bfloat16()
    residual = torch.randn(4, 32, generator=gen).bfloat16()
    out, updated = norm.add_and_norm(delta, residual)
    assert torch.equal(updated, residual + delta)
    xf = updated.float()
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(out, want)


@pytest.mark.parametrize("switch", ["_FOLD_ON", "linear._GEMV_ON", "norm._EPILOGUES_ON"])
def test_norm_folding_needs_its_switch_the_gemv_and_the_epilogues(monkeypatch: pytest.MonkeyPatch, switch: str):
    """Folding at load only pays where batch-1 steps take the folded GEMV route: with any of the three switches
    off the norms would run on folded weights, so nothing folds."""
    from sglx.llm.layers import linear, norm, norm_folding

    monkeypatch.setattr(linear, "use_fused", lambda t: True)
    weight = torch.zeros(8, 4096, dtype=torch.bfloat16)
    assert norm_folding.folding_applies(4096, weight, 1)
    assert not norm_folding.folding_applies(4096, weight, 2)  # o_proj's epilogue add needs the whole sum
    assert not norm_folding.folding_applies(2048, weight, 1)  # the norm goes inside the GEMV at this width
    assert not norm_folding.folding_applies(4096, weight.float(), 1)
    owner, name = {"_FOLD_ON": (norm_folding, "_FOLD_ON"), "linear._GEMV_ON": (linear, "_GEMV_ON"),
                   "norm._EPILOGUES_ON": (norm, "_EPILOGUES_ON")}[switch]
    monkeypatch.setattr(owner, name, False)
    assert not norm_folding.folding_applies(4096, weight, 1)
