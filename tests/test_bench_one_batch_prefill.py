"""`sglx bench one-batch`'s prefill against its compute floor, on a CPU with tiny random models.

The floor's GEMM and attention FLOPs must equal an independent count from the checkpoint's config.json
(every projection of every layer at the prefill's token count, the LM head on the last token of each
request only), its parts must be measured (positive) and add up, and the report must carry them. The
timed prefills must come after a warm-up prefill and run with Python's cyclic GC paused.
"""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llm_test_utils import make_tiny_model
from sglx.cli.app import app

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("one_batch_prefill"), "llama")


def _config_counts(model_dir: Path, bs: int, n: int, window: int | None = None) -> tuple[int, int, dict]:
    """(GEMM FLOPs, attention FLOPs, {projection: (m, n, k, layers)}) of one prefill, from config.json alone."""
    c = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // hq
    t = bs * n
    shapes = {"qkv": (t, (hq + 2 * hkv) * d, h, layers), "o": (t, h, hq * d, layers),
              "gate_up": (t, 2 * inter, h, layers), "down": (t, h, inter, layers), "lm_head": (bs, vocab, h, 1)}
    gemm = sum(2 * m * nn * k * count for m, nn, k, count in shapes.values())
    visible = sum(min(i + 1, window) if window else i + 1 for i in range(n))  # keys each query sees
    attention = layers * 4 * bs * hq * d * visible
    return gemm, attention, shapes


def test_report_has_prefill_floor_matching_config_flops(tiny: Path, tmp_path: Path) -> None:
    from rich.console import Console

    from sglx.bench.one_batch import report_table

    out = tmp_path / "one_batch.json"
    result = CliRunner().invoke(app, ["bench", "one-batch", "--model-path", str(tiny), "--batch-size", "1,3",
                                      "--input-len", "7", "--output-len", "3", "--prefill-runs", "3", "--device", "cpu",
                                      "--dtype", "float32", "--attention-backend", "torch_native", "--json",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert "GEMMs" in report["prefill_floor"] and "GC paused" in report["timing"]
    for r in report["results"]:
        bs = r["batch_size"]
        assert r["prefill_runs"] == 3 and len(r["prefill_ms_all"]) == 3
        assert r["prefill_ms"] == pytest.approx(statistics.median(r["prefill_ms_all"]))
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        assert r["prefills_before_timing"] == 1 and r["prefill_first_ms"] > 0
        assert r["prefill_device_ms_median"] is None and r["prefill_device_ratio_to_floor"] is None  # GPU only
        assert r["prefill_tokens_per_s"] == pytest.approx(bs * 7 / (r["prefill_ms"] * 1e-3))

        gemm_flops, attention_flops, shapes = _config_counts(tiny, bs, 7)
        assert r["prefill_gemm_flops"] == gemm_flops
        assert r["prefill_attention_flops"] == attention_flops
        assert {g["name"]: (g["m"], g["n"], g["k"], g["count"]) for g in r["prefill_floor_gemms"]} == shapes
        assert all(g["ms_per_call"] > 0 for g in r["prefill_floor_gemms"])
        [att] = r["prefill_floor_attention"]
        assert (att["batch"], att["tokens"], att["count"], att["window"]) == (bs, 7, 2, None)
        assert att["ms_per_call"] > 0 and att["call"].startswith("sdpa")
        assert r["prefill_floor_gemm_ms"] == pytest.approx(sum(g["ms_per_call"] * g["count"]
                                                               for g in r["prefill_floor_gemms"]))
        assert r["prefill_floor_attention_ms"] == pytest.approx(att["ms_per_call"] * 2)
        assert r["prefill_floor_gemm_ms"] > 0 and r["prefill_floor_attention_ms"] > 0
        assert r["prefill_floor_ms"] == pytest.approx(r["prefill_floor_gemm_ms"] + r["prefill_floor_attention_ms"])
        assert r["prefill_ratio_to_floor"] == pytest.approx(r["prefill_ms"] / r["prefill_floor_ms"])

    console = Console(record=True, width=300)
    console.print(report_table(report))
    text = console.export_text()
    assert "prefill / floor" in text and f"{report['results'][1]['prefill_ratio_to_floor']:.2f}x" in text


def test_sliding_window_floor_counts_only_keys_in_the_window(tmp_path: Path) -> None:
    import torch

    from sglx.bench.prefill_floor import measure_prefill_floor
    from sglx.bench.timing import TimingBudget
    from sglx.llm.models import load_model

    mistral = make_tiny_model(tmp_path, "mistral")  # sliding window 8 < 12 tokens
    model, _ = load_model(mistral, "float32", "cpu")
    floor = measure_prefill_floor(model, 2, 12, torch.device("cpu"), TimingBudget(warmup_ms=1, rep_ms=2, min_runs=2))
    gemm_flops, attention_flops, _ = _config_counts(mistral, 2, 12, window=8)
    report = floor.as_dict()
    assert report["prefill_gemm_flops"] == gemm_flops and report["prefill_attention_flops"] == attention_flops
    assert [a["window"] for a in report["prefill_floor_attention"]] == [8]
    assert floor.floor_ms == pytest.approx(floor.gemm_ms + floor.attention_ms) and floor.attention_ms > 0


def test_timed_prefills_follow_a_warm_up_with_gc_paused(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.bench import one_batch
    from sglx.llm.engine_config import EngineConfig

    gc_on_during_prefill: list[bool] = []
    original = one_batch._BatchRun.prefill

    def recording(self: one_batch._BatchRun):  # type: ignore[no-untyped-def]
        gc_on_during_prefill.append(gc.isenabled())
        return original(self)

    monkeypatch.setattr(one_batch._BatchRun, "prefill", recording)
    assert gc.isenabled()
    report = one_batch.run_one_batch(
        EngineConfig(model_path=str(tiny), device="cpu", dtype="float32", attention_backend="torch_native"),
        one_batch.OneBatchConfig(batch_sizes=(1,), input_len=5, output_len=3, prefill_runs=4, prefill_floor=False))
    assert gc_on_during_prefill == [True, False, False, False, False]  # warm-up, then 4 timed with GC paused
    assert gc.isenabled()
    [r] = report["results"]
    assert r["prefills_before_timing"] == 1 and len(r["prefill_ms_all"]) == 4
    assert r["prefill_floor_ms"] is None and "--no-prefill-floor" in r["prefill_floor_why"]
    assert r["prefill_ratio_to_floor"] is None


def test_floor_is_absent_with_a_reason_for_mla_moe_models(tmp_path: Path) -> None:
    import torch

    from sglx.bench.prefill_floor import unsupported_reason
    from sglx.llm.model_config import load_model_config
    from sglx.llm.models import build_model

    deepseek = make_tiny_model(tmp_path, "deepseek_v2")
    model = build_model(load_model_config(deepseek), torch.float32, "meta")
    assert "DeepseekV2ForCausalLM" in (unsupported_reason(model) or "")


def test_prefill_runs_below_one_is_a_usage_error(tiny: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "one-batch", "--model-path", str(tiny), "--device", "cpu",
                                      "--prefill-runs", "0"])
    assert result.exit_code == 2 and "--prefill-runs 0: must be >= 1" in result.output, result.output
