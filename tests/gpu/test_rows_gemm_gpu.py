"""The few-row decode GEMM (sglx.llm.kernels.rows_gemm) at Llama-3.1-8B sizes against float64: plain products with and
without K splits (as close as cuBLAS), the residual add in place, the gated and folded-norm epilogues, and the
split tickets reset across CUDA graph replays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the GPU tier
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 1000)]
EPS = 1e-5


def _operands(m: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(n + k + m)
    x = torch.randn(m, k, device=DEV, dtype=dtype, generator=gen)
    return x, (torch.randn(n, k, device=DEV, generator=gen) * k ** -0.5).to(dtype)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [64, 33, 16, 2])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_product_matches_float64_as_closely_as_cublas(n, k, m, splits, dtype):
    from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm

    x, w = _operands(m, n, k, dtype)
    got = rows_gemm(x, w, config=RowsGemmConfig(splits=splits))
    want = x.double() @ w.double().T
    ref = F.linear(x, w)
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (ref.double() - want).abs().max().item() + 1e-6, err


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_residual_add_in_place_equals_torch_add_of_the_product(n, k):
    from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm

    x, w = _operands(64, n, k, torch.bfloat16)
    stream = torch.randn(64, n, device=DEV).bfloat16()
    product = rows_gemm(x, w, config=RowsGemmConfig(splits=2))
    want = stream + product  # the same product (same split), then torch's add
    rows_gemm(x, w, add_to=stream, out=stream, config=RowsGemmConfig(splits=2))
    assert torch.equal(stream, want)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("splits", [None, 2])
def test_gated_and_folded_norm_epilogues_match_float64(rms, splits):
    from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm

    m, inter, k = 48, 14336, 4096
    x, w = _operands(m, 2 * inter, k, torch.bfloat16)
    x = (x.float() * torch.linspace(0.25, 8, m, device=DEV)[:, None]).bfloat16()
    xd = x.double()
    if rms:
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    gu = xd @ w.double().T
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    got = rows_gemm(x, w, gated=True, rms_eps=EPS if rms else None, config=RowsGemmConfig(splits=splits))
    # the unfused route's error: the rounded normed rows (rms) and the rounded gate_up product, then SiLU-and-mul
    h = (xd.to(torch.bfloat16) if rms else x)
    ref_gu = F.linear(h, w)
    ref = F.silu(ref_gu[:, :inter].float()).bfloat16() * ref_gu[:, inter:]
    err = (got.double() - want).abs().max().item()
    assert err <= 1.5 * (ref.double() - want).abs().max().item() + 1e-6, err


def test_split_tickets_reset_across_graph_replays():
    from sglx.llm.kernels.rows_gemm import RowsGemmConfig, rows_gemm

    x, w = _operands(64, 4096, 4096, torch.bfloat16)
    want = rows_gemm(x, w, config=RowsGemmConfig(splits=4))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows_gemm(x, w, config=RowsGemmConfig(splits=4))
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
