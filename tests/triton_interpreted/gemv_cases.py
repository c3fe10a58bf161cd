"""sglx.llm.kernels.gemv (one-row GEMV, with the residual add + RMSNorm inside it) against float64.

Runs only under TRITON_INTERPRET=1 (tests/test_gemv.py launches it in a child pytest). The products are checked
against float64 within twice the error of float64 products rounded once to the output dtype plus a few roundings
of the sum; the norm variant against float64 of the norm without roundings (the kernel skips Hugging Face's two
roundings of the normed row, see _gemv_kernel) and against the layers' norm-then-linear within one rounding of
the normed row; the residual the kernel writes must equal torch's add bit for bit. The same runs at real sizes on
the GPU (tests/gpu/test_gemv_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_gemv.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.gemv import GemvConfig, NormInput, gemv  # noqa: E402

EPS = 1e-5
# (N, K, config): N not a multiple of the feature block, K not a multiple of the input step, several steps
CASES = [(37, 96, GemvConfig(4, 32)), (64, 64, GemvConfig(8, 16)), (5, 33, GemvConfig(4, 32)),
         (16, 100, GemvConfig(16, 64))]


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _bound(want: torch.Tensor, dtype: torch.dtype) -> float:
    """Two roundings of the largest output to `dtype` (the kernel's output rounding and its float32 sum)."""
    return 2 * torch.finfo(dtype).eps * want.abs().max().item() + 1e-6


def _operands(n: int, k: int, dtype: torch.dtype, bias: bool) -> tuple:
    """(x [1, k], w [n, k], bias [n] or None) of the plain GEMV cases."""
    x = _randn(1, k, seed=n + k, dtype=dtype)
    w = _randn(n, k, seed=2 * n + k, dtype=dtype, scale=k ** -0.5)
    return x, w, (_randn(n, seed=3, dtype=dtype) if bias else None)


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_float64(n, k, config, dtype, bias):
    x, w, b = _operands(n, k, dtype, bias)
    got, residual = gemv(x, w, b, config=config, interpret=True)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert residual is None and got.shape == (1, n) and got.dtype == dtype
    assert (got.double() - want).abs().max().item() <= _bound(want, dtype)


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_adding_to_a_row_is_torchs_add_of_the_product(n, k, config, dtype, bias):
    """add_to: the product rounded to the dtype, then torch's add to the row (one more rounding), bit for bit."""
    x, w, b = _operands(n, k, dtype, bias)
    r = _randn(1, n, seed=11, dtype=dtype, scale=4.0)
    got, residual = gemv(x, w, b, config=config, interpret=True, add_to=r)
    product = gemv(x, w, b, config=config, interpret=True)[0]
    assert residual is None and got.shape == (1, n) and torch.equal(got, r + product)
    assert not torch.equal(got, product)
    with pytest.raises(ValueError, match="add_to"):
        gemv(x, w, b, NormInput(torch.ones(k, dtype=dtype), EPS), interpret=True, add_to=r)


@pytest.mark.parametrize("n,k,config", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_with_the_norm_inside_matches_float64_and_writes_torchs_residual(n, k, config, dtype, with_residual):
    from sglx.llm.layers.norm import RMSNorm

    x = _randn(1, k, seed=n, dtype=dtype, scale=3.0)
    r = _randn(1, k, seed=n + 1, dtype=dtype, scale=3.0) if with_residual else None
    g = (1 + _randn(k, seed=n + 2, dtype=torch.float64, scale=0.2)).to(dtype)
    w = _randn(n, k, seed=n + 3, dtype=dtype, scale=k ** -0.5)
    b = _randn(n, seed=n + 4, dtype=dtype)
    got, updated = gemv(x, w, b, NormInput(g, EPS, r), config=config, interpret=True)
    stream = (r + x) if r is not None else x  # torch's add, one rounding
    if with_residual:
        assert torch.equal(updated, stream)
    else:
        assert updated is None
    s = stream.double()
    normed = g.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    want = normed @ w.double().t() + b.double()
    assert (got.double() - want).abs().max().item() <= _bound(want, dtype)
    norm = RMSNorm(k, EPS)
    norm.weight.data = g
    layers = (norm.add_and_norm(x, r)[0] if r is not None else norm(x)).double() @ w.double().t() + b.double()
    step = torch.finfo(dtype).eps * (w.double().abs() @ normed.abs().t()).max().item()  # one rounding of the row
    assert (got.double() - layers).abs().max().item() <= step + _bound(want, dtype)


def test_gemv_refuses_more_than_one_row_and_mismatched_widths():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, dtype=torch.bfloat16), w, interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(torch.zeros(1, 8, dtype=torch.bfloat16), w, interpret=True)
