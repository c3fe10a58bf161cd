"""`sglx bench one-batch` on a CPU with a tiny random Llama: the report's numbers are what they claim.

The greedy tokens it decodes must equal Hugging Face's for the same prompt (so the benchmark times
the real model, prefill and decode through the paged KV cache), the weight bytes must equal the
checkpoint's tensors minus the embedding rows a step does not read, and the floor and ratios must
follow from the measured bandwidth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.bench.one_batch import make_prompts
from sglx.cli.app import app


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("one_batch"), "llama")


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_report_matches_hf_tokens_and_independent_byte_counts(tiny: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "one_batch.json"
    result = CliRunner().invoke(app, ["bench", "one-batch", "--model-path", str(tiny), "--batch-size", "1,3",
                                      "--input-len", "7", "--output-len", "5", "--device", "cpu", "--dtype", "float32",
                                      "--attention-backend", "torch_native", "--page-size", "4", "--json",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert json.loads(result.stdout) == report
    assert report["cuda_graph"] is False and "cpu" in report["cuda_graph_why"]
    assert report["decode_attention_backend"] == "torch_native" and report["page_size"] == 4
    bandwidth = report["copy_bandwidth_gb_per_s"] * 1e9
    assert bandwidth > 0

    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    all_bytes = sum(t.numel() * 4 for t in tensors.values())  # float32
    embed = tensors["model.embed_tokens.weight"]
    hf = load_hf_model(tiny)
    prompts = make_prompts(embed.shape[0], 3, 7, seed=0)
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32

    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        bs = r["batch_size"]
        assert r["decode_steps"] == 4 and r["prefill_ms"] > 0 and r["decode_steps_in_cuda_graphs"] == 0
        assert r["decode_step_ms_min"] <= r["decode_step_ms_median"] <= r["decode_step_ms_max"]
        assert r["decode_tokens_per_s"] == pytest.approx(bs / (r["decode_step_ms_median"] * 1e-3))
        assert r["prefill_tokens_per_s"] == pytest.approx(bs * 7 / (r["prefill_ms"] * 1e-3))
        assert r["weight_bytes_per_step"] == all_bytes - embed.numel() * 4 + bs * embed.shape[1] * 4
        assert r["kv_bytes_per_step"] == bs * (7 + 2 + 1) * kv_per_token  # median of 4 steps: position 7 + 2
        floor_ms = (r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / bandwidth * 1e3
        assert r["floor_ms"] == pytest.approx(floor_ms, rel=1e-6)
        assert r["ratio_to_floor"] == pytest.approx(r["decode_step_ms_median"] / floor_ms, rel=1e-6)
        for i, tokens in enumerate(r["output_ids"]):  # the prefill's token, then 4 decode steps
            assert tokens == hf_greedy(hf, prompts[i].tolist(), 5)[0], (bs, i)


def test_bad_options_are_usage_errors(tiny: Path) -> None:
    for args, message in ((("--output-len", "1"), "must be >= 2"), (("--batch-size", "x"), "give integers"),
                          (("--batch-size", "0"), "sizes >= 1")):
        result = CliRunner().invoke(app, ["bench", "one-batch", "--model-path", str(tiny), "--device", "cpu", *args])
        assert result.exit_code == 2 and message in result.output, result.output
