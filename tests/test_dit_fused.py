"""The fused DiT kernels (q/k prologue, norm + modulation, gated residual): interpreted Triton cases, torch path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglx.diffusion.dit_attention import apply_interleaved_rotary
from sglx.diffusion.fused import fused_kernels
from sglx.diffusion.qk_norm_rope import norm_rope
from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_matches_torch_under_the_interpreter() -> None:
    run_interpreted("dit_fused_cases.py")


def test_cpu_takes_the_torch_path_with_diffusers_arithmetic() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 6, 4 * 8)
    norm = torch.nn.RMSNorm(32, eps=1e-6)
    cos, sin = torch.rand(1, 6, 1, 8), torch.rand(1, 6, 1, 8)
    with fused_kernels(True):
        got = norm_rope(x, norm, 4, (cos, sin))
    q = norm(x).unflatten(2, (4, -1))
    x0, x1 = q[..., 0::2], q[..., 1::2]
    want = torch.empty_like(q)
    want[..., 0::2] = x0 * cos[..., 0::2] - x1 * sin[..., 1::2]  # diffusers' Wan rotary, written out
    want[..., 1::2] = x0 * sin[..., 1::2] + x1 * cos[..., 0::2]
    assert torch.equal(got, want)
    assert torch.equal(apply_interleaved_rotary(q, cos, sin), want)
