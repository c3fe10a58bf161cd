"""fp8 KV with ONE K and ONE V scale per layer (FlashInfer's and XQA's contract), calibrated from the first prefill.

`--kv-cache-scales calibrate` (the default for per-layer-scale backends when the checkpoint has no k_scale/v_scale):
scale = amax of the first prefill's K (rotated keys) / 200 and V / 100 (vLLM's --calculate-kv-scales rule), then
frozen. Here: the math against float64, the freeze, the engine flag, checkpoint scales winning, and the embedded
model's recall through torch_native over such a pool (stored fp8 * layer scale: FlashInfer's arithmetic). The
FlashInfer/XQA query side (rotated queries) is checked against float64 stand-ins in test_flashinfer_backend.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from llm_test_utils import embedded_recall
from sglx.llm.forward_batch import ForwardMode


def _keys(n: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Keys like a trained model's: a few large channels, token norms spread over two decades."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, dim, generator=gen) * (0.05 + 5 * torch.rand(n, 1, 1, generator=gen))
    k[..., 5] *= 20
    return k


def test_calibrated_scales_match_float64_and_stay_frozen():
    from sglx.llm.kv_cache import TokenKVPool

    n, heads, dim = 48, 2, 64
    pool = TokenKVPool(2 * n + 8, 8, 2, heads, dim, torch.float32, "fp8_e4m3")
    assert pool.scale_source == "one" and pool.k_rotation is None
    pool.calibrate_static_scales(rotate_keys=True)
    assert pool.scales_pending == [True, True] and not pool.per_token_scales and pool.k_rotation is not None
    k, v = _keys(n, heads, dim), torch.randn(n, heads, dim) * 3
    loc = torch.randperm(n) + 8
    pool.set_kv(1, loc, k, v)
    rot = pool.k_rotation.double()
    assert torch.allclose(rot @ rot.t(), torch.eye(dim, dtype=torch.float64), atol=1e-6)
    want_k = float((k.double() @ rot).abs().max()) / 200
    want_v = float(v.double().abs().max()) / 100
    assert pool.k_scale[1] == pytest.approx(want_k, rel=1e-5) and pool.v_scale[1] == pytest.approx(want_v, rel=1e-6)
    assert pool.scales_pending == [True, False] and pool.k_scale[0] == 1.0  # per layer, on that layer's first store
    info = pool.describe_scales()
    assert info["source"] == "calibrated_rotated" and info["pending"]
    assert info["k_scale"][1] == round(pool.k_scale[1], 6)
    # the pool holds fp8((k @ R) / scale): what FlashInfer dequantizes as bits * k_scale in the rotated basis
    held_k = pool.k_buffer[1][loc].view(pool.fp8_dtype).double() * pool.k_scale[1]
    held_v = pool.v_buffer[1][loc].view(pool.fp8_dtype).double() * pool.v_scale[1]
    rel = ((held_k - k.double() @ rot).norm(dim=-1) / k.double().norm(dim=-1)).max().item()
    assert rel < 0.04, rel
    assert ((held_v - v.double()).abs() / v.double().abs().amax()).max().item() < 0.05  # half an e4m3 step at 100
    assert held_k.abs().max().item() == pytest.approx(200 * pool.k_scale[1], rel=0.07)  # amax lands near 200
    back_k, back_v = pool.get_kv(1, loc, torch.float64)  # rotation undone
    assert torch.allclose(back_k, held_k @ rot.t(), atol=1e-5) and torch.allclose(back_v, held_v)
    # rotated queries over the held keys score like plain queries over get_kv's keys (FlashInfer's paged path)
    q = torch.randn(5, heads, dim)
    assert torch.allclose(torch.einsum("qhd,khd->hqk", pool.rotate_query(q).double(), held_k),
                          torch.einsum("qhd,khd->hqk", q.double(), back_k), atol=1e-4, rtol=1e-5)
    # frozen: larger later values keep the scale and saturate at e4m3's 448 instead of overflowing
    scale = pool.k_scale[1]
    pool.set_kv(1, loc[:4] + n, k[:4] * 10, v[:4] * 10)
    assert pool.k_scale[1] == scale
    big = pool.k_buffer[1][loc[:4] + n].view(pool.fp8_dtype).float()
    assert torch.isfinite(big).all() and big.abs().max().item() == 448.0


def test_calibration_waits_for_a_prefill_step():
    """A decode step (and a CUDA-graph capture, which is one) never sets the scales: its K/V may be padding."""
    from sglx.attention.llm.kv_store import calibrate_from_first_prefill
    from sglx.llm.kv_cache import TokenKVPool

    pool = TokenKVPool(40, 8, 1, 2, 32, torch.float32, "fp8_e4m3")
    pool.calibrate_static_scales(rotate_keys=False)
    k, v = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    calibrate_from_first_prefill(pool, 0, k, v, types.SimpleNamespace(mode=ForwardMode.DECODE))
    assert pool.scales_pending == [True] and pool.k_scale == [1.0]
    calibrate_from_first_prefill(pool, 0, k, v, types.SimpleNamespace(mode=ForwardMode.EXTEND))
    assert pool.scales_pending == [False] and pool.k_scale[0] == pytest.approx(float(k.abs().max()) / 200)
    assert pool.k_rotation is None and pool.scale_source == "calibrated"


def test_engine_kv_cache_scales_modes():
    from sglx.errors import SglxError
    from sglx.llm.engine import Engine
    from sglx.llm.engine_config import EngineConfig

    prompt, params = "k3=abcde; ? k3=", {"max_new_tokens": 6, "temperature": 0.0}
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                max_total_tokens=256) as eng:
        before = eng.info["kv_cache_scales"]
        assert before["source"] == "calibrated_rotated" and before["pending"] and before["rotated_keys"]
        assert eng.generate(prompt, params)["text"] == "abcde"
        after = eng.info["kv_cache_scales"]
        assert not after["pending"] and all(0 < s < 1 for s in after["k_scale"] + after["v_scale"])
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="one",
                max_total_tokens=256) as eng:
        pool = eng.runner.token_kv_pool
        assert pool.scale_source == "one" and pool.k_scale == [1.0] * pool.num_layers and pool.k_rotation is None
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", max_total_tokens=256) as eng:
        assert eng.info["kv_cache_scales"]["source"] == "per_token"  # auto: torch_native reads per-token scales
    with pytest.raises(SglxError, match="--kv-cache-scales bogus: choose one of auto, calibrate, one"):
        EngineConfig(kv_cache_scales="bogus")


def test_checkpoint_scales_win_over_calibration(tmp_path):
    from sglx.llm.engine import Engine
    from test_fp8_kv_scales import llama_with_kv_scales

    path, layers = llama_with_kv_scales(tmp_path)
    with Engine(model_path=str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                max_total_tokens=512) as eng:
        pool = eng.runner.token_kv_pool
        eng.generate(input_ids=list(range(3, 30)), sampling_params={"max_new_tokens": 2, "temperature": 0.0})
        assert pool.scale_source == "checkpoint" and pool.k_rotation is None and not any(pool.scales_pending)
        assert pool.k_scale == [pytest.approx(0.02 + 0.01 * i) for i in range(layers)]


def test_embedded_model_recall_with_calibrated_per_layer_scales():
    """One scale per layer from the first prefill, rotated keys: at least 78% of these 64 prompts (measured 55/64,
    and 85-88.5% on 2 x 200 others; one scale of 1.0 per layer: 52-54%). Not the issue's 98%: per-token scales
    (triton, torch_native) or layer 1 kept out of fp8 (test_fp8_skip_layers.py) reach that; docs/benchmarks.md."""
    right, asked, pool = embedded_recall(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3",
                                         kv_cache_scales="calibrate", dtype="float32")
    assert not pool.per_token_scales and pool.k_rotation is not None and not any(pool.scales_pending)
    print(f"\nfp8_e4m3 recall with calibrated per-layer scales: {right}/{asked}")
    assert right / asked >= 0.78


def test_server_warm_up_leaves_pending_scales_to_the_first_real_prefill():
    """`sglx serve`'s warm-up request has synthetic tokens: it must not become the calibration batch."""
    from sglx.llm.engine import Engine
    from sglx.server.runner import warm_up

    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                max_total_tokens=256) as eng:
        warm_up(eng)
        assert eng.runner.token_kv_pool.calibrating
        assert eng.generate("k3=abcde; ? k3=", {"max_new_tokens": 6, "temperature": 0.0})["text"] == "abcde"
        assert not eng.runner.token_kv_pool.calibrating
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="one",
                max_total_tokens=256) as eng:
        warm_up(eng)  # nothing pending: the warm-up runs (and is flushed)
        assert eng.runner.token_kv_pool.scale_source == "one"


def test_cuda_graphs_are_captured_after_the_calibrating_prefill(monkeypatch):
    """Captured graphs bake the scales in: with scales pending the runner captures after the first prefill, once
    (CPU: the graph plan and runner are stand-ins that record when they are built)."""
    import sglx.llm.model_runner as mr
    from sglx.llm.cuda_graph_runner import CudaGraphPlan
    from sglx.llm.engine import Engine

    built = []

    class RecordingRunner:
        replays = 0

        def __init__(self, target, plan) -> None:  # noqa: ANN001
            built.append(target.token_kv_pool.calibrating)

        def can_run(self, batch) -> bool:  # noqa: ANN001
            return False  # every step stays eager on the CPU

    monkeypatch.setattr(mr, "cuda_graph_plan", lambda *a, **k: CudaGraphPlan(True, 4, (1, 2, 4), "stand-in"))
    monkeypatch.setattr(mr, "CudaGraphRunner", RecordingRunner)
    for scales, at_start in (("calibrate", []), ("one", [False])):
        built.clear()
        with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales=scales,
                    max_total_tokens=256) as eng:
            assert built == at_start and (eng.runner.graph_runner is None) == (scales == "calibrate")
            eng.generate(["k3=abcde; ? k3=", "k1=xyzwv; ? k1="], {"max_new_tokens": 3, "temperature": 0.0})
            assert built == [False]  # once, and never while the scales were still pending
            assert isinstance(eng.runner.graph_runner, RecordingRunner)
