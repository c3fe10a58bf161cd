"""Interpreted cases (TRITON_INTERPRET=1): the fused DiT kernels against diffusers' torch arithmetic."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_dit_fused.py"

from sglx.diffusion.dit_attention import apply_interleaved_rotary  # noqa: E402
from sglx.diffusion.qk_norm_rope_triton import launch  # noqa: E402


def _rotary(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's tables: float64 angles, repeated per pair, stored as float32 [1, S, 1, D]."""
    pos = torch.arange(seq, dtype=torch.float64)[:, None]
    freqs = pos / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = freqs.repeat_interleave(2, dim=-1)
    return freqs.cos().float().view(1, seq, 1, dim), freqs.sin().float().view(1, seq, 1, dim)


@pytest.mark.parametrize(("batch", "seq", "heads", "dim", "rope", "fused_qkv"), [
    (1, 7, 3, 32, True, False), (2, 5, 12, 16, True, True), (1, 9, 2, 64, False, False), (1, 4, 5, 32, False, True),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_torch(batch: int, seq: int, heads: int, dim: int, rope: bool, fused_qkv: bool,
                       dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    n = heads * dim
    qkv = (torch.randn(batch, seq, 3 * n) * 3).to(dtype)
    x = qkv[..., n:2 * n] if fused_qkv else qkv[..., :n].contiguous()  # a strided chunk of a fused projection
    norm = torch.nn.RMSNorm(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n) + 0.5)
    rotary = _rotary(seq, dim) if rope else None
    want = norm(x).unflatten(2, (heads, -1))
    if rotary is not None:
        want = apply_interleaved_rotary(want, *rotary)
    got = launch(x, norm.weight.detach(), 1e-6, heads, rotary)
    assert got.shape == (batch, seq, heads, dim) and got.dtype == dtype and got.is_contiguous()
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert (got.float() - want.float()).abs().max().item() <= 2 * ulp * want.float().abs().max().item()


@pytest.mark.parametrize(("batch", "seq", "n", "affine", "modulate"), [
    (1, 5, 48, False, True), (2, 3, 100, True, False), (2, 4, 64, False, True), (1, 3, 96, True, True),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ln_modulate_matches_diffusers(batch: int, seq: int, n: int, affine: bool, modulate: bool,
                                       dtype: torch.dtype) -> None:
    from diffusers.models.normalization import FP32LayerNorm

    from sglx.diffusion.modulation_triton import ln_modulate

    torch.manual_seed(1)
    x = (torch.randn(batch, seq, n) * 2 + 0.5).to(dtype)
    norm = FP32LayerNorm(n, 1e-6, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(n) + 0.5)
            norm.bias.copy_(torch.randn(n))
    table = torch.randn(batch, 6, n)  # (scale_shift_table + temb).chunk(6, dim=1): strided [B, 1, n] views
    shift, scale = table.chunk(6, dim=1)[:2]
    want = norm(x.float())
    if modulate:
        want = want * (1 + scale) + shift
    want = want.type_as(x)
    got = ln_modulate(x, norm.weight if affine else None, norm.bias if affine else None, 1e-6,
                      scale if modulate else None, shift if modulate else None)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() <= ulp * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_residual_matches_diffusers(dtype: torch.dtype) -> None:
    from sglx.diffusion.modulation_triton import gate_residual

    torch.manual_seed(2)
    h, y = (torch.randn(2, 5, 72).to(dtype) for _ in range(2))
    gate = torch.randn(2, 6, 72).chunk(6, dim=1)[2]
    want = (h.float() + y * gate).type_as(h)  # diffusers' expression
    got = gate_residual(h, y, gate)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10  # the interpreter rounds to bf16 toward zero
    assert (got.float() - want.float()).abs().max().item() <= ulp * want.float().abs().max().item()
