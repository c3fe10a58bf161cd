"""Interpreted cases (TRITON_INTERPRET=1): the fused DiT q/k prologue against diffusers' torch arithmetic."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_dit_prologue.py"

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
