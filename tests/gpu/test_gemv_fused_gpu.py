"""The GEMVs with epilogues at Llama-3.1-8B sizes: each equals the unfused kernels it replaces (the plain GEMV, then
SiLU-and-mul / rotary + K/V store) bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the GPU tier
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")


def _rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_out,k", [(14336, 4096), (1408, 2048), (1000, 1000)])
def test_gated_gemv_equals_gemv_then_silu_and_mul(n_out, k, dtype):
    from sglx.llm.kernels.activation import silu_and_mul
    from sglx.llm.kernels.gemv import gemv
    from sglx.llm.kernels.gemv_gated import gemv_gated

    x, w = _rand(1, k, seed=1, scale=2.0, dtype=dtype), _rand(2 * n_out, k, seed=2, scale=k ** -0.5, dtype=dtype)
    b = _rand(2 * n_out, seed=3, dtype=dtype)
    assert torch.equal(gemv_gated(x, w, b), silu_and_mul(gemv(x, w, b)[0]))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("hq,hkv,d,k", [(32, 8, 128, 4096), (28, 4, 128, 3584), (8, 8, 64, 512)])
def test_rotary_gemv_equals_gemv_then_rotary_and_store(hq, hkv, d, k, kv_cache_dtype):
    from sglx.attention.llm.kv_store import StepKVSlots
    from sglx.llm.kernels.gemv import gemv
    from sglx.llm.kernels.gemv_rotary import gemv_rotary_store
    from sglx.llm.kernels.rotary import apply_rotary_and_store_
    from sglx.llm.kv_cache import TokenKVPool
    from sglx.llm.layers.rotary import RotaryEmbedding

    rows = (hq + 2 * hkv) * d
    x, w, b = _rand(1, k, seed=11, scale=2.0), _rand(rows, k, seed=12, scale=k ** -0.5), _rand(rows, seed=13)
    cos, sin = RotaryEmbedding(d, 500000.0, None, 8192).cos_sin(torch.tensor([3071], device=DEV), torch.bfloat16)
    loc = torch.tensor([77], device=DEV)
    pools = [TokenKVPool(128, 1, 1, hkv, d, torch.bfloat16, kv_cache_dtype, DEV) for _ in range(2)]
    for p in pools:
        p.k_scale[0], p.v_scale[0] = (0.04, 0.02) if p.is_fp8 else (1.0, 1.0)
    slots = [StepKVSlots(p.k_buffer[0], p.v_buffer[0], loc, float(p.k_scale[0]), float(p.v_scale[0]), p.fp8_dtype)
             for p in pools]
    q = gemv_rotary_store(x, w, b, cos, sin, hq, hkv, slots[0])
    q2, k2, v2 = gemv(x, w, b)[0].split([hq * d, hkv * d, hkv * d], dim=-1)
    q2, k2 = q2.reshape(1, hq, d).clone(), k2.reshape(1, hkv, d).clone()
    s = slots[1]
    apply_rotary_and_store_(q2, k2, v2.reshape(1, hkv, d), cos, sin, s.k_buffer, s.v_buffer, loc, s.k_scale,
                            s.v_scale, s.fp8_dtype)
    assert torch.equal(q, q2[0])
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
