"""fp8 KV cache with per-token scales, rotated keys and checkpoint scales.

The Triton cases run in a child pytest under TRITON_INTERPRET=1 (tests/triton_interpreted/fp8_scale_cases.py);
here: the pool's own quantization, checkpoint `k_scale`/`v_scale` loading, and the embedded model's recall.
"""

from __future__ import annotations

import importlib.util

import pytest

from llm_test_utils import embedded_recall
from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fp8_scale_kernels_match_float64_under_the_interpreter():
    run_interpreted("fp8_scale_cases.py")


def _keys(n: int, heads: int, dim: int, seed: int = 0):
    """Keys like a trained model's: a few large channels, token norms spread over two decades."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dim, generator=gen) * (0.05 + 5 * torch.rand(n, 1, 1, generator=gen))
    k[..., 5] *= 20
    return k


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_per_token_pool_round_trip_and_layout(kv_cache_dtype):
    import torch

    from sglx.llm.kv_cache import FP8_MAX, TokenKVPool, quantize_per_token

    n, heads, dim = 64, 2, 64
    pool = TokenKVPool(n + 8, 8, 2, heads, dim, torch.float32, kv_cache_dtype, per_token_scales=True)
    static = TokenKVPool(n + 8, 8, 2, heads, dim, torch.float32, kv_cache_dtype)
    assert pool.per_token_scales and not static.per_token_scales
    assert pool.bytes_per_token() == static.bytes_per_token() + 2 * heads * 2 * 4  # float32 K and V scales
    rot = pool.k_rotation.double()
    assert torch.allclose(rot @ rot.t(), torch.eye(dim, dtype=torch.float64), atol=1e-6)
    k, v = _keys(n, heads, dim), torch.randn(n, heads, dim)
    loc = torch.randperm(n) + 8
    pool.set_kv(1, loc, k, v)
    assert pool.k_buffer[0].eq(0).all()  # other layers untouched
    back_k, back_v = pool.get_kv(1, loc, torch.float64)
    bound = 0.04 if kv_cache_dtype == "fp8_e4m3" else 0.08
    k_rel = ((back_k - k.double()).norm(dim=-1) / k.double().norm(dim=-1)).max().item()
    v_rel = ((back_v - v.double()).abs() / v.double().abs().amax(-1, keepdim=True)).max().item()
    assert k_rel < bound and v_rel < 2 * bound, (k_rel, v_rel)
    # the scale search never rounds worse than the plain amax scale, and is better on average
    x = k.float() @ pool.k_rotation
    fp8 = pool.fp8_dtype
    plain_bits, plain_scale = quantize_per_token(x, fp8, None)
    best_bits, best_scale = quantize_per_token(x, fp8, pool.scale_multipliers)
    plain = ((plain_bits.view(fp8).float() * plain_scale[..., None] - x) ** 2).sum(-1)
    best = ((best_bits.view(fp8).float() * best_scale[..., None] - x) ** 2).sum(-1)
    assert (best <= plain).all() and best.mean() < 0.8 * plain.mean()
    assert torch.equal(plain_scale, x.abs().amax(-1) / FP8_MAX[fp8])
    # per-slot scales live slot-major: pool.k_scale[layer][slot, head]
    assert pool.k_scale[1].shape == (n + 16, heads) and torch.equal(pool.k_scale[1][loc], best_scale)
    # rotated queries over the stored (rotated) keys score like plain queries over get_kv's keys
    q = torch.randn(3, heads, dim)
    stored = pool.k_buffer[1][loc].view(fp8).float() * pool.k_scale[1][loc][..., None]
    assert torch.allclose(torch.einsum("qhd,khd->hqk", pool.rotate_query(q), stored),
                          torch.einsum("qhd,khd->hqk", q, back_k.float()), atol=1e-3, rtol=1e-4)


def _add_kv_scales(model_dir, scales: dict[str, float]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def llama_with_kv_scales(tmp_path):  # noqa: ANN001, ANN201
    """A tiny Llama whose checkpoint carries k_scale/v_scale 0.02 + 0.01 * layer: (its folder, its layer count)."""
    from llm_test_utils import make_tiny_model

    path = make_tiny_model(tmp_path, "llama")
    layers = json_layers(path)
    _add_kv_scales(path, {f"model.layers.{i}.self_attn.{kind}_scale": 0.02 + 0.01 * i
                          for i in range(layers) for kind in ("k", "v")})
    return path, layers


def test_checkpoint_kv_scales_are_loaded_and_used(tmp_path):
    """vLLM/SGLang-named k_scale/v_scale (and the k_proj.output_scale spelling) become static per-layer scales."""

    from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
    from sglx.errors import SglxError
    from sglx.llm.engine import Engine

    path = make_tiny_model(tmp_path, "llama")
    layers = json_layers(path)
    scales = {}
    for i in range(layers):
        if i % 2:
            scales[f"model.layers.{i}.self_attn.k_proj.output_scale"] = 0.02 + 0.01 * i
            scales[f"model.layers.{i}.self_attn.v_proj.output_scale"] = 0.03
        else:
            scales[f"model.layers.{i}.self_attn.k_scale"] = 0.02 + 0.01 * i
            scales[f"model.layers.{i}.self_attn.v_scale"] = 0.03
    hf = load_hf_model(path)
    prompt = list(range(3, 40))
    tokens, _ = hf_greedy(hf, prompt, 8)
    _add_kv_scales(path, scales)
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", max_total_tokens=512) as eng:
        pool = eng.runner.token_kv_pool
        assert not pool.per_token_scales and pool.k_rotation is None
        assert pool.k_scale == [pytest.approx(0.02 + 0.01 * i) for i in range(layers)]
        assert pool.v_scale == [pytest.approx(0.03)] * layers
        fp8_out = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        # what the pool holds is fp8(k / checkpoint scale): the prompt's slots decode to multiples of the scale
        held = pool.k_buffer[0][1:len(prompt)].view(pool.fp8_dtype).float()
        assert held.abs().max() > 1.0  # keys of ~0.5-5 divided by 0.02: not 1.0-scaled bytes
    assert fp8_out[:2] == tokens[:2]
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=512) as eng:  # no fp8: scales ignored
        assert eng.generate(input_ids=prompt, sampling_params=params)["output_ids"] == tokens
    del scales["model.layers.0.self_attn.v_scale"]
    other = make_tiny_model(tmp_path, "llama")
    _add_kv_scales(other, scales)
    with pytest.raises(SglxError, match="KV-cache scales.*layer\\(s\\) \\[0\\]"):
        Engine(model_path=str(other), dtype="float32", kv_cache_dtype="fp8_e4m3", max_total_tokens=512)


def json_layers(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def test_embedded_model_keeps_its_recall_with_fp8_e4m3_kv():
    """The issue's bar: >= 98% exact answers at the longest trained context with an fp8_e4m3 KV cache.

    With one scale of 1.0 per layer this model answered 53%; per-token scales with rotated keys keep it.
    torch_native here; triton's kernels read the same bytes (fp8_scale_cases.py) and were run on a GPU.
    """
    right, asked, pool = embedded_recall(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3",
                                         dtype="float32")
    assert pool.per_token_scales
    print(f"\nfp8_e4m3 recall: {right}/{asked}")
    assert right / asked >= 0.98


def test_backends_that_read_one_scale_per_layer_get_a_static_pool(monkeypatch):
    """A selected backend without kv_scales_per_token (FlashInfer takes one scale per layer) gets static scales."""
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.llm.engine import Engine

    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", max_total_tokens=256) as eng:
        assert eng.runner.token_kv_pool.per_token_scales
    monkeypatch.setattr(TorchNativeBackend, "kv_scales_per_token", False)
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", max_total_tokens=256) as eng:
        pool = eng.runner.token_kv_pool  # static scales from the first prefill over rotated keys (--kv-cache-scales)
        assert not pool.per_token_scales and pool.calibrating and pool.k_rotation is not None
        assert eng.generate("k3=abcde; ? k3=", {"max_new_tokens": 6, "temperature": 0.0})["text"]
        assert not pool.calibrating and all(s != 1.0 for s in pool.k_scale)
