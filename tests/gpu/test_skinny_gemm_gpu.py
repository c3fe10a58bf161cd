"""The skinny decode GEMM at Llama-3.1-8B projection sizes against float64, and its dispatch rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the GPU tier
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (3584 + 2 * 512, 3584)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_gemm_at_llama_sizes_matches_float64(n, k, rows, dtype):
    from sglx.llm.kernels.skinny_gemm import skinny_linear

    gen = torch.Generator(device=DEV).manual_seed(n + k + rows)
    x = torch.randn(rows, k, device=DEV, dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=DEV, dtype=dtype, generator=gen)
    got = skinny_linear(x, w, b)
    want = F.linear(x.double(), w.double(), b.double())
    ref = F.linear(x, w, b)  # cuBLAS: same inputs, its own rounding
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (ref.double() - want).abs().max().item() + 1e-6, err


def test_linear_layer_takes_the_skinny_path_only_when_asked_for_few_half_rows(monkeypatch):
    from sglx.llm.kernels import skinny_gemm
    from sglx.llm.layers.linear import Linear

    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    plain = Linear(256, 512, bias=True).to(DEV, torch.bfloat16)
    plain(torch.randn(4, 256, device=DEV, dtype=torch.bfloat16))
    assert calls == []  # skinny=False (the default): cuBLAS
    layer = Linear(256, 512, bias=True, skinny=True).to(DEV, torch.bfloat16)
    for rows in (1, 16, 17):
        x = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    layer.float()(torch.randn(2, 256, device=DEV))  # float32 stays on cuBLAS
    assert calls == [torch.Size([16, 256])]  # one row takes the GEMV (test_gemv_gpu.py)
