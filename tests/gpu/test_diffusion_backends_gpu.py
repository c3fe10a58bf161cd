"""fa and sage_attn on the GPU against a float64 reference: head dims 64 and 128, odd lengths, GQA, cross-attention."""

from __future__ import annotations

import math

import pytest
import torch

from sglx import platform
from sglx.attention.checks import tolerance
from sglx.attention.registry import availability, chosen_variant, find

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, query tokens, key tokens, query heads, kv heads, head dim)
    (1, 1000, 1000, 12, 12, 128),
    (2, 333, 333, 8, 2, 64),
    (1, 4097, 4097, 4, 4, 128),
    (2, 777, 512, 6, 6, 128),  # cross-attention to 512 text tokens
    (1, 65, 129, 2, 1, 64),
]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    return (torch.softmax(q64 @ k64.transpose(-1, -2) * scale, dim=-1) @ v64).transpose(1, 2)


def _backend(name: str):  # type: ignore[no-untyped-def]
    snap = platform.current()
    spec = find(name, "diffusion", "dit")
    avail = availability(spec, snap)
    if not avail.ok:
        pytest.skip(f"{name}: {'; '.join(avail.reasons)}")
    return spec, spec.load()({})


@pytest.mark.parametrize("name", ["fa", "sage_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("b", "sq", "skv", "hq", "hkv", "d"), SHAPES)
def test_matches_float64(name: str, dtype: torch.dtype, b: int, sq: int, skv: int, hq: int, hkv: int,
                         d: int) -> None:
    spec, backend = _backend(name)
    gen = torch.Generator(device="cuda").manual_seed(sq + skv)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(b, skv, hkv, d, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(b, skv, hkv, d, device="cuda", generator=gen, dtype=dtype)
    k_before = k.clone()
    scale = 0.9 / math.sqrt(d)
    out = backend.forward_dense(q, k, v, scale=scale) if sq != skv else backend.forward(q, k, v, scale=scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(k, k_before)
    err = (out.double() - _reference(q, k, v, scale)).abs().max().item()
    assert err <= tolerance(spec, dtype), (name, getattr(backend, "variant", None), err)


def test_fa_runs_the_variant_doctor_names() -> None:
    spec, backend = _backend("fa")
    assert backend.variant == chosen_variant(spec, platform.current()).name
