"""The L2 weight prefetcher stays out of the way where it cannot help: CPU tensors, eager steps, the off switch."""

from __future__ import annotations

import torch

from sglx.llm.layers.weight_prefetch import WeightPrefetcher, prefetch_enabled


def test_switch_reads_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("SGLX_L2_PREFETCH", raising=False)
    assert prefetch_enabled() and WeightPrefetcher().enabled
    for off in ("0", "off", "False"):
        monkeypatch.setenv("SGLX_L2_PREFETCH", off)
        assert not prefetch_enabled() and not WeightPrefetcher().enabled
    assert WeightPrefetcher(enabled=True).enabled


def test_cpu_step_issues_nothing_and_join_is_a_no_op() -> None:
    prefetcher = WeightPrefetcher(enabled=True)
    x, w = torch.randn(1, 8), torch.randn(8, 8)
    prefetcher.issue(x, w)
    prefetcher.join()
    assert prefetcher._streams == {} and prefetcher._pending is None


def test_llama_layers_share_the_models_prefetcher(tmp_path) -> None:
    from llm_test_utils import make_tiny_model
    from sglx.llm.engine import Engine

    path = make_tiny_model(tmp_path, "llama")
    with Engine(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=512) as eng:
        model = eng.runner.model.model
        assert all(layer.self_attn.prefetch is model.prefetch for layer in model.layers)
        out = eng.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3, "temperature": 0.0})
        assert len(out[0]["output_ids"]) == 3 and model.prefetch._streams == {}
