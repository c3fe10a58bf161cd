"""sglx.llm.kernels.mla_rotary vs the torch rotation DeepSeek's attention runs on CPU: bit-identical, interpreted.

Runs only under TRITON_INTERPRET=1 (tests/test_deepseek_kernels.py launches it in a child pytest).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_deepseek_kernels.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.mla_rotary import apply_mla_rotary_  # noqa: E402
from sglx.llm.layers.rotary import RotaryEmbedding  # noqa: E402
from sglx.llm.models.deepseek import rotate_interleaved, rotate_neox  # noqa: E402


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(3, 5, 64), (1, 16, 8)])
def test_mla_rotary_equals_the_torch_path(interleaved, dtype, tokens, heads, dim):
    gen = torch.Generator().manual_seed(dim + heads)
    nope, latent = 16, 32
    q = torch.randn(tokens, heads * (nope + dim), generator=gen).to(dtype)  # the model's q_proj output
    kv = torch.randn(tokens, latent + dim, generator=gen).to(dtype)  # kv_a_proj output: [c_kv, k_pe]
    rope = RotaryEmbedding(dim, 10000.0, None, 4096)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 4000][:tokens]), dtype)
    q_pe = q.view(tokens, heads, nope + dim)[..., nope:]
    k_pe = kv[:, latent:]
    rotate = rotate_interleaved if interleaved else rotate_neox
    want_q, want_k = rotate(q_pe, cos, sin), rotate(k_pe[:, None, :], cos, sin)[:, 0]
    q_before, kv_before = q.clone(), kv.clone()
    apply_mla_rotary_(q_pe, k_pe, cos, sin, interleaved)
    assert torch.equal(q_pe, want_q) and torch.equal(k_pe, want_k)
    untouched = torch.ones(tokens, heads, nope + dim, dtype=torch.bool)
    untouched[..., nope:] = False
    assert torch.equal(q.view(tokens, heads, -1)[untouched], q_before.view(tokens, heads, -1)[untouched])
    assert torch.equal(kv[:, :latent], kv_before[:, :latent])


@pytest.mark.parametrize("kv_cache_dtype,scale", [("auto", 1.0), ("fp8_e4m3", 1.0), ("fp8_e4m3", 0.37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rotary_store_writes_what_set_latent_writes(kv_cache_dtype, scale, dtype):
    """store=: each token's [c_kv, rotated k_pe] lands in its slot exactly as MLATokenKVPool.set_latent puts it."""
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    tokens, heads, dim, latent = 3, 4, 16, 40
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(tokens, heads, 8 + dim, generator=gen).to(dtype)
    kv = torch.randn(tokens, latent + dim, generator=gen).to(dtype)
    c_kv = torch.randn(tokens, latent, generator=gen).to(dtype)  # the normalized latent (a separate tensor)
    cos, sin = RotaryEmbedding(dim, 10000.0, None, 512).cos_sin(torch.tensor([3, 9, 100]), dtype)
    slots = torch.tensor([5, 2, 11])
    pools = [MLATokenKVPool(16, 1, 1, latent, dim, dtype, kv_cache_dtype) for _ in range(2)]
    for pool in pools:
        pool.kv_scale[0] = scale
    k_pe = kv[:, latent:]
    want_k = rotate_interleaved(k_pe[:, None, :], cos, sin)[:, 0]
    pools[0].set_latent(0, slots, c_kv, want_k)
    apply_mla_rotary_(q[..., 8:], k_pe, cos, sin, True,
                      (c_kv, pools[1].kv_buffer[0], slots, pools[1].kv_scale[0], pools[1].fp8_dtype))
    assert torch.equal(k_pe, want_k)
    assert torch.equal(pools[1].kv_buffer[0], pools[0].kv_buffer[0])


def test_tiny_deepseek_with_the_fused_rotary_and_store_matches_transformers(tmp_path, monkeypatch):
    """The model's GPU path for RoPE (q_pe and k_pe rotated in place, the latent row stored by the same kernel,
    the backend's own store skipped), here interpreted: logits and greedy tokens equal transformers'."""
    from llm_test_utils import PagedKVHarness, assert_paged_greedy_matches_hf, load_hf_model, make_tiny_model
    from sglx.attention.llm.mla_base import MLAAttentionBackend
    from sglx.llm.models import deepseek, load_model

    monkeypatch.setattr(deepseek, "use_fused", lambda t: True)
    stores = []
    monkeypatch.setattr(MLAAttentionBackend, "save_latent", staticmethod(lambda *a: stores.append(1)))
    path = make_tiny_model(tmp_path, "deepseek_v3")
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    prompt = [1, 57, 203, 99, 12, 310, 44, 8, 150, 77, 201, 5, 66]
    harness = PagedKVHarness(model, page_size=4, max_requests=2, max_context=64)
    assert_paged_greedy_matches_hf(harness, hf, prompt, 5)
    assert not stores  # every latent row came from the rotary kernel


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rotary_kv_norm_equals_kv_a_layernorm_then_store(kv_cache_dtype, dtype):
    """kv_norm=: the raw latent normalised in place as kv_a_layernorm does (torch's arithmetic, rounded where it
    rounds), and the stored row equals set_latent of the normalised latent; a kv_norm without store is refused."""
    from sglx.llm.layers.norm import RMSNorm
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    tokens, heads, dim, latent = 3, 4, 16, 40
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(tokens, heads, 8 + dim, generator=gen).to(dtype)
    kv = (3 * torch.randn(tokens, latent + dim, generator=gen)).to(dtype)  # the kv_a_proj output [c_kv, k_pe]
    norm = RMSNorm(latent, 1e-6).to(dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(latent, generator=gen)).to(dtype)
    cos, sin = RotaryEmbedding(dim, 10000.0, None, 512).cos_sin(torch.tensor([3, 9, 100]), dtype)
    slots = torch.tensor([5, 2, 11])
    pools = [MLATokenKVPool(16, 1, 1, latent, dim, dtype, kv_cache_dtype) for _ in range(2)]
    want_c = norm._torch(kv[:, :latent])
    want_k = rotate_interleaved(kv[:, None, latent:], cos, sin)[:, 0]
    pools[0].set_latent(0, slots, want_c, want_k)
    c_kv, k_pe = kv[:, :latent], kv[:, latent:]
    apply_mla_rotary_(q[..., 8:], k_pe, cos, sin, True,
                      (c_kv, pools[1].kv_buffer[0], slots, pools[1].kv_scale[0], pools[1].fp8_dtype),
                      (norm.weight.data, norm.eps))
    # the float32 sum of squares may add in another order than torch's mean: at most one rounding step apart
    torch.testing.assert_close(c_kv, want_c, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=0)
    assert torch.equal(k_pe, want_k)
    if dtype == torch.float32 and kv_cache_dtype == "auto":
        torch.testing.assert_close(pools[1].kv_buffer[0], pools[0].kv_buffer[0], rtol=1e-6, atol=0)
    else:
        stored = pools[1].get_latent(0, slots, torch.float32)
        torch.testing.assert_close(stored, pools[0].get_latent(0, slots, torch.float32), rtol=0.07, atol=1e-3)
    with pytest.raises(ValueError, match="pass store too"):
        apply_mla_rotary_(q[..., 8:], k_pe, cos, sin, True, None, (norm.weight.data, norm.eps))
