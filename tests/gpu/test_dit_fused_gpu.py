"""The fused DiT kernels compiled on the GPU against diffusers' torch arithmetic, at Wan2.1-1.3B widths."""

from __future__ import annotations

import pytest
import torch

from sglx.diffusion.fused import fused_kernels
from sglx.diffusion.modulation import gate_residual, ln_modulate
from sglx.diffusion.qk_norm_rope import norm_rope

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _both(fn):  # type: ignore[no-untyped-def]
    with fused_kernels(True):
        got = fn()
    with fused_kernels(False):
        want = fn()
    return got, want


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("modulate", [False, True])
def test_ln_modulate(affine: bool, modulate: bool) -> None:
    pytest.importorskip("diffusers", reason="the reference is diffusers' FP32LayerNorm (carry .whl/diffusers)")
    from diffusers.models.normalization import FP32LayerNorm

    torch.manual_seed(0)
    x = torch.randn(2, 1000, 1536, device=DEV).bfloat16()
    norm = FP32LayerNorm(1536, 1e-6, elementwise_affine=affine).to(DEV)
    if affine:
        with torch.no_grad():
            norm.bias.normal_()
    shift, scale = torch.randn(2, 6, 1536, device=DEV).chunk(6, dim=1)[:2]
    got, want = _both(lambda: ln_modulate(x, norm, scale if modulate else None, shift if modulate else None))
    ulp = (want.float().abs() * 2 ** -8).clamp_min(1e-6)
    assert ((got.float() - want.float()).abs() <= ulp).float().mean() > 0.999  # at most a rounding apart


def test_gate_residual() -> None:
    """Triton contracts h + y * gate into one FMA (torch rounds the product first): equal up to a rounding.

    The float32 sums differ by at most the product's float32 rounding (2^-24 |y * gate|, doubled for the
    sums' own roundings), and rounding both to bf16 can then land one bf16 ulp apart: the ulp of `want`
    itself (2^(e - 8) for |want| in [2^(e-1), 2^e)), not |want| * 2^-8, which is only half an ulp just
    above a power of two."""
    torch.manual_seed(1)
    h, y = (torch.randn(2, 1000, 1536, device=DEV).bfloat16() for _ in range(2))
    gate = torch.randn(2, 6, 1536, device=DEV).chunk(6, dim=1)[2]
    got, want = _both(lambda: gate_residual(h, y, gate))
    w = want.float()
    _, exponent = torch.frexp(w)
    bf16_ulp = torch.where(w == 0, torch.zeros_like(w), torch.ldexp(torch.ones_like(w), exponent - 8))
    bound = bf16_ulp + (y.float() * gate).abs() * 2 ** -23
    assert ((got.float() - w).abs() <= bound).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_norm_rope(fused_qkv: bool) -> None:
    torch.manual_seed(2)
    s, heads, dim = 1000, 12, 128
    qkv = (torch.randn(2, s, 3 * heads * dim, device=DEV) * 3).bfloat16()
    x = qkv[..., : heads * dim] if fused_qkv else qkv[..., : heads * dim].contiguous()
    norm = torch.nn.RMSNorm(heads * dim, eps=1e-6).to(DEV).bfloat16()
    angles = torch.rand(1, s, 1, dim // 2, device=DEV, dtype=torch.float64).repeat_interleave(2, -1) * 6
    rotary = (angles.cos().float(), angles.sin().float())
    with torch.no_grad():
        got, want = _both(lambda: norm_rope(x, norm, heads, rotary))
    assert got.shape == want.shape == (2, s, heads, dim)
    ulp = (want.float().abs() * 2 ** -7).clamp_min(1e-6)
    assert ((got.float() - want.float()).abs() <= ulp).float().mean() > 0.999
