"""fp8 KV with some layers kept in the model dtype (`--kv-cache-dtype-skip-layers`, vLLM's kv_cache_dtype_skip_layers).

For backends that take one K and one V scale per layer (flashinfer, trtllm_mha): no static scale, per channel or
per layer, gives the embedded model's layer-1 keys the mantissa bits they need (docs/benchmarks.md, fp8 section),
so that layer stays unquantized. Here: the pool against float64, the engine flag and its errors, and the embedded
model's recall through torch_native over such a pool (stored fp8 x layer scale on the other layers: FlashInfer's
arithmetic). The FlashInfer/XQA plans per KV dtype are checked against float64 stand-ins in
test_flashinfer_backend.py, the Triton store kernel in triton_interpreted/fp8_scale_cases.py.
"""

from __future__ import annotations

import pytest
import torch

from llm_test_utils import embedded_recall
from sglx.errors import SglxError


def test_pool_keeps_the_named_layers_in_the_model_dtype():
    from sglx.llm.kv_cache import TokenKVPool

    n, heads, dim = 20, 2, 64
    pool = TokenKVPool(n + 4, 4, 3, heads, dim, torch.float16, "fp8_e4m3")
    fp8_bytes = pool.bytes_per_token()
    pool.calibrate_static_scales(rotate_keys=True)
    pool.keep_unquantized((1,))
    assert [pool.layer_fp8_dtype(i) for i in range(3)] == [torch.float8_e4m3fn, None, torch.float8_e4m3fn]
    assert pool.k_buffer[1].dtype == pool.v_buffer[1].dtype == torch.float16 and pool.k_buffer[0].dtype == torch.uint8
    assert pool.scales_pending == [True, False, True] and pool.calibrating
    assert pool.bytes_per_token() == fp8_bytes + heads * 2 * dim  # one layer at 2 bytes instead of 1
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(n, heads, dim, generator=gen) * 3, torch.randn(n, heads, dim, generator=gen)
    loc = torch.randperm(n, generator=gen) + 4
    for layer in range(3):
        pool.set_kv(layer, loc, k.half(), v.half())
    assert not pool.calibrating and pool.k_scale[1] == pool.v_scale[1] == 1.0 and pool.k_scale[0] != 1.0
    want_k, want_v = k.half().double(), v.half().double()
    back_k, back_v = pool.get_kv(1, loc, torch.float64)
    assert torch.equal(back_v, want_v)
    assert (back_k - want_k).abs().max().item() < 1e-2  # fp16 rounding of the rotated keys only
    fp8_k, fp8_v = pool.get_kv(0, loc, torch.float64)  # the fp8 layers round at e4m3's ~2^-4 relative error
    assert 1e-2 < (fp8_k - want_k).abs().max().item() < 0.1 * want_k.abs().max().item()
    info = pool.describe_scales()
    assert info["unquantized_layers"] == [1] and info["k_scale"][1] == 1.0


def test_pool_refuses_what_it_cannot_keep():
    from sglx.llm.kv_cache import TokenKVPool

    pool = TokenKVPool(8, 4, 2, 1, 32, torch.float16, "fp8_e4m3")
    with pytest.raises(SglxError, match=r"--kv-cache-dtype-skip-layers 2: the model has layers 0\.\.1"):
        pool.keep_unquantized((2,))
    per_token = TokenKVPool(8, 4, 2, 1, 32, torch.float16, "fp8_e4m3", per_token_scales=True)
    with pytest.raises(SglxError, match="per-token scales keep every layer's accuracy"):
        per_token.keep_unquantized((0,))
    plain = TokenKVPool(8, 4, 2, 1, 32, torch.float16)
    plain.keep_unquantized((0,))  # nothing is fp8: nothing to keep
    assert plain.unquantized_layers == frozenset() and plain.k_buffer[0].dtype == torch.float16


def test_engine_flag_validation_and_backends_that_read_one_kv_dtype(monkeypatch):
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.llm.engine import Engine
    from sglx.llm.engine_config import EngineConfig

    assert EngineConfig(kv_cache_dtype_skip_layers="3, 1,3").kv_cache_skip_layers() == (1, 3)
    assert EngineConfig().kv_cache_skip_layers() == ()
    for bad in ("one", "1,,2", "-1"):
        with pytest.raises(SglxError, match=f"--kv-cache-dtype-skip-layers {bad}: give layer indices"):
            EngineConfig(kv_cache_dtype_skip_layers=bad)
    with pytest.raises(SglxError, match="the model has layers 0..3"):
        Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
               kv_cache_dtype_skip_layers="4", max_total_tokens=256)
    with pytest.raises(SglxError, match="per-token scales keep every layer's accuracy"):
        Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers="1",
               max_total_tokens=256)
    # a backend that reads every layer in the pool's one KV dtype (triton, fa3, ...: no kv_dtype_per_layer)
    monkeypatch.setattr(TorchNativeBackend, "kv_dtype_per_layer", False)
    with pytest.raises(SglxError, match="attention backend torch_native reads every layer's KV in one dtype"):
        Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
               kv_cache_dtype_skip_layers="1", max_total_tokens=256)


def test_embedded_model_recall_with_layer_1_kept_out_of_fp8():
    """Calibrated per-layer scales over rotated keys with layer 1 unquantized: at least 98% (the issue's target;
    measured 64/64, and 2 x 200 others in docs/benchmarks.md) where all four layers in fp8 give 55/64."""
    right, asked, pool = embedded_recall(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3",
                                         kv_cache_scales="calibrate", kv_cache_dtype_skip_layers="1", dtype="float32")
    assert pool.unquantized_layers == frozenset({1}) and pool.k_buffer[1].dtype == torch.float32
    assert pool.k_buffer[0].dtype == torch.uint8 and not any(pool.scales_pending)
    print(f"\nfp8_e4m3 recall, calibrated per-layer scales, layer 1 kept: {right}/{asked}")
    assert right / asked >= 0.98


def test_registry_feature_matches_what_the_engine_checks():
    """The registry's fp8_kv_dtype_per_layer (docs) and the backend class attribute the engine checks agree for
    every LLM MHA backend sglx implements."""
    from sglx.attention.registry import backend_names, find

    declared = {}
    for name in backend_names("llm"):
        spec = find(name, "llm", "mha")
        if spec is None or not spec.factory:
            continue
        declared[name] = (spec.features.fp8_kv_dtype_per_layer, getattr(spec.load(), "kv_dtype_per_layer", False))
    assert {n for n, (feature, _) in declared.items() if feature} == {"flashinfer", "trtllm_mha", "torch_native"}
    assert all(feature == attr for feature, attr in declared.values()), declared


def test_checkpoint_scales_with_a_layer_kept(tmp_path):
    """A checkpoint's k_scale/v_scale still apply to the fp8 layers; the kept layer reads back unscaled."""
    from sglx.llm.engine import Engine
    from test_fp8_kv_scales import llama_with_kv_scales

    path, layers = llama_with_kv_scales(tmp_path)
    with Engine(model_path=str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_dtype_skip_layers="0",
                max_total_tokens=512, attention_backend="torch_native") as eng:
        pool = eng.runner.token_kv_pool
        out = eng.generate(input_ids=list(range(3, 30)), sampling_params={"max_new_tokens": 2, "temperature": 0.0})
        assert len(out["output_ids"]) == 2
        assert pool.scale_source == "checkpoint" and pool.unquantized_layers == frozenset({0})
        assert pool.k_scale == [1.0] + [pytest.approx(0.02 + 0.01 * i) for i in range(1, layers)]
        assert pool.k_buffer[0].dtype == torch.float32 and pool.k_buffer[1].dtype == torch.uint8
