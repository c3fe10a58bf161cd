"""The one-row GEMV at Llama-3.1-8B and DeepSeek-V2-Lite projection sizes against float64, with the norm inside it,
and the layers' dispatch to it (one CUDA half row: the GEMV; more rows: cuBLAS or the skinny GEMM)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the GPU tier
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (3648, 2048), (2048, 2048),
          (1000, 1000)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_at_model_sizes_matches_float64_as_closely_as_cublas(n, k, dtype):
    from sglx.llm.kernels.gemv import gemv

    gen = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, dtype=dtype, generator=gen)
    w = (torch.randn(n, k, device=DEV, dtype=dtype, generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=DEV, dtype=dtype, generator=gen)
    got = gemv(x, w, b)[0]
    want = F.linear(x.double(), w.double(), b.double())
    ref = F.linear(x, w, b)  # cuBLAS: same inputs, its own rounding
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (ref.double() - want).abs().max().item() + 1e-6, err


@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (3648, 2048)])
def test_gemv_with_the_add_and_norm_inside_matches_float64(n, k):
    from sglx.llm.kernels.gemv import NormInput, gemv
    from sglx.llm.layers.norm import RMSNorm

    gen = torch.Generator(device=DEV).manual_seed(n)
    x, r = (torch.randn(1, k, device=DEV, generator=gen).mul_(4).bfloat16() for _ in range(2))
    g = (1 + 0.2 * torch.randn(k, device=DEV, generator=gen)).bfloat16()
    w = (torch.randn(n, k, device=DEV, generator=gen) * k ** -0.5).bfloat16()
    got, updated = gemv(x, w, None, NormInput(g, 1e-6, r))
    assert torch.equal(updated, r + x)
    s = (r + x).double()
    want = (g.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w.double().t()
    norm = RMSNorm(k, 1e-6).to(DEV, torch.bfloat16)
    norm.weight.data = g
    layers = F.linear(norm.add_and_norm(x, r)[0], w)  # norm kernel (HF's roundings) then cuBLAS
    err = (got.double() - want).abs().max().item()
    assert err <= (layers.double() - want).abs().max().item() + 1e-6, err


def test_layers_send_one_half_row_to_the_gemv(monkeypatch):
    from sglx.llm.kernels import gemv as gemv_module
    from sglx.llm.layers.linear import Linear
    from sglx.llm.layers.norm import RMSNorm

    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    layer = Linear(256, 512, bias=True).to(DEV, torch.bfloat16)
    for rows in (1, 2):
        x = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    layer.float()(torch.randn(1, 256, device=DEV))  # float32 stays on cuBLAS
    norm = RMSNorm(512).to(DEV, torch.bfloat16)
    h = torch.randn(1, 512, device=DEV, dtype=torch.bfloat16)
    y, updated = norm.norm_linear(h, None, torch.randn(64, 512, device=DEV, dtype=torch.bfloat16))
    assert torch.equal(updated, h) and y.shape == (1, 64)
    assert calls == [torch.Size([1, 256]), torch.Size([1, 512])]
