"""sglx.llm.kernels.rows_gemm (few-row GEMM, split over K with a last-split reduce, epilogues) against float64.

Runs only under TRITON_INTERPRET=1 (tests/test_rows_gemm.py launches it in a child pytest). Products are checked
against float64 within a few roundings of the largest output; the residual-add epilogue against float64 of the
product rounded once then added (torch's two roundings), the gated epilogue against float64 silu(gate) * up of the
rounded products, the folded norm against float64 rmsnorm(x) @ W^T without roundings of the normed rows. Splits
and tiles are chosen so that K splits unevenly, columns and rows end mid-tile, and the tickets must reset between
launches (each case launches twice).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_rows_gemm.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm  # noqa: E402

EPS = 1e-5
# (rows, N, K, config): rows below the 16-row tile, N not a multiple of the tile, K splitting unevenly
CASES = [(3, 40, 96, RowsGemmConfig(16, 32, 1)), (5, 37, 100, RowsGemmConfig(16, 32, 3)),
         (17, 64, 64, RowsGemmConfig(32, 16, 2)), (1, 16, 48, RowsGemmConfig(16, 16, 3))]


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _bound(want: torch.Tensor, dtype: torch.dtype, roundings: int = 2) -> float:
    return roundings * torch.finfo(dtype).eps * want.abs().max().item() + 1e-6


def _operands(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _randn(m, k, seed=m + n + k, dtype=dtype), _randn(n, k, seed=n * k, dtype=dtype, scale=k ** -0.5)


DTYPES = [torch.float16]  # the interpreter's tl.dot mishandles bf16; the GPU tier runs bf16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_product_matches_float64_and_tickets_reset(m, n, k, config, dtype):
    x, w = _operands(m, n, k, dtype)
    want = x.double() @ w.double().T
    for _ in range(2):  # the second launch finds the tickets the first left at zero
        got = rows_gemm(x, w, config=config, interpret=True)
        assert got.shape == (m, n) and got.dtype == dtype
        assert (got.double() - want).abs().max().item() <= _bound(want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_residual_add_in_place_rounds_as_torch(m, n, k, config, dtype):
    x, w = _operands(m, n, k, dtype)
    r = _randn(m, n, seed=7, dtype=dtype)
    want = (x.double() @ w.double().T).to(dtype).double() + r.double()
    stream = r.clone()
    got = rows_gemm(x, w, add_to=stream, out=stream, config=config, interpret=True)
    assert got.data_ptr() == stream.data_ptr()
    # the product's own error (two roundings of it) plus the add's rounding
    assert (got.double() - want).abs().max().item() <= _bound(want, dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_gated_epilogue_is_silu_of_gate_times_up(m, n, k, config, dtype):
    x, w = _operands(m, 2 * n, k, dtype)
    gu = x.double() @ w.double().T
    want = F.silu(gu[:, :n]) * gu[:, n:]
    got = rows_gemm(x, w, gated=True, config=config, interpret=True)
    assert got.shape == (m, n)
    # gate and up each rounded (their products' error reaches the output through silu's slope <= 1.1 and up)
    assert (got.double() - want).abs().max().item() <= _bound(want, dtype, 6)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_folded_norm_scales_each_row_by_its_rms(m, n, k, config, gated):
    dtype = torch.float16
    x, w = _operands(m, 2 * n if gated else n, k, dtype)
    x = (x.double() * torch.linspace(0.5, 4.0, m, dtype=torch.float64)[:, None]).to(dtype)  # rows of unlike rms
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS)
    y = normed @ w.double().T
    want = F.silu(y[:, :n]) * y[:, n:] if gated else y
    got = rows_gemm(x, w, gated=gated, rms_eps=EPS, config=config, interpret=True)
    assert (got.double() - want).abs().max().item() <= _bound(want, dtype, 6 if gated else 2)


def test_bad_shapes_are_refused():
    x, w = _operands(3, 8, 16, torch.float16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        rows_gemm(torch.zeros(65, 16, dtype=torch.float16), w, interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        rows_gemm(x[:, :8], w, interpret=True)
    with pytest.raises(ValueError, match="add_to must be"):
        rows_gemm(x, w, add_to=torch.zeros(3, 9, dtype=torch.float16), interpret=True)
