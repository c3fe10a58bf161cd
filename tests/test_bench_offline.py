"""`sglx bench offline-throughput` and the serving/offline comparison: identical prompts to `sglx bench serving`,
token counts equal to what the engine produced, ratios and their refusals; end to end against a real
`sglx serve`, checked through the official openai client."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from server_test_utils import ENGINE_ARGS, ServerProcess, start_server
from server_test_utils import model_path as pick_model
from sglx.bench.offline_throughput import OfflineBenchConfig, offline_prompts, run_offline, sampling_params
from sglx.bench.serving import ServingBenchConfig, _stats, build_prompts, prompts_fingerprint
from sglx.bench.serving_report import THROUGHPUT_KEYS, report_table, vs_offline
from sglx.cli.app import app
from sglx.errors import SglxError
from sglx.llm.engine import Engine

DATASET = {"num_prompts": 6, "input_len": 24, "output_len": 5, "range_ratio": 0.5, "seed": 3}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pick_model(tmp_path_factory.mktemp("offline_model"))


@pytest.fixture(scope="module")
def engine(model: Path) -> Any:
    with Engine(model_path=str(model), max_total_tokens=4096, max_running_requests=8, dtype="float32") as e:
        yield e


@pytest.mark.parametrize("options", [
    {},
    {"range_ratio": 0.3, "length_dist": "normal", "seed": 11},
    {"prompt_kind": "text"},
    {"vocab_size": 50},
])
def test_offline_prompts_are_the_serving_prompts(options: dict[str, Any]) -> None:
    cfg = OfflineBenchConfig(**{**DATASET, **options})
    serving_cfg = ServingBenchConfig(**{**DATASET, **options})
    # what the serving bench builds against a server whose /server_info reports vocab_size 97
    server_vocab = None if options.get("prompt_kind") == "text" else options.get("vocab_size", 97)
    served = build_prompts(serving_cfg, server_vocab)
    offline = offline_prompts(cfg, 97)
    assert offline == served
    assert prompts_fingerprint(offline) == prompts_fingerprint(served)
    other = offline_prompts(OfflineBenchConfig(**{**DATASET, **options, "seed": 99}), 97)
    assert prompts_fingerprint(other) != prompts_fingerprint(offline)


def test_bad_options_are_the_serving_bench_errors() -> None:
    with pytest.raises(SglxError, match="--random-range-ratio 2"):
        OfflineBenchConfig(range_ratio=2)
    result = CliRunner().invoke(app, ["bench", "offline-throughput", "--num-prompts", "0"])
    assert result.exit_code == 2 and "--num-prompts 0" in result.output


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_offline_counts_equal_the_engine_outputs(engine: Any, max_concurrency: int | None) -> None:
    cfg = OfflineBenchConfig(**DATASET, max_concurrency=max_concurrency)
    report = run_offline(engine, cfg)
    prompts = offline_prompts(cfg, engine.model_config.vocab_size)
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_input_tokens"] == sum(len(p.prompt) for p in prompts)
    assert report["total_output_tokens"] == sum(p.output_len for p in prompts)  # ignore_eos: exactly max_tokens
    assert report["output_token_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration_s"])
    assert report["prompts_sha256"] == prompts_fingerprint(prompts)


def test_offline_counts_stop_at_eos_as_the_engine_does(engine: Any) -> None:
    cfg = OfflineBenchConfig(**DATASET, ignore_eos=False, prompt_kind="text")
    prompts = offline_prompts(cfg, engine.model_config.vocab_size)
    direct = engine.generate([p.prompt for p in prompts], [sampling_params(cfg, p) for p in prompts])
    report = run_offline(engine, cfg)
    assert report["total_output_tokens"] == sum(r["completion_tokens"] for r in direct)
    assert report["total_input_tokens"] == sum(len(engine.encode(p.prompt)) for p in prompts)


# ------------------------------------------------------------------------------------------ comparison


def _report(scale: float, sha: str = "abc", failed: int = 0) -> dict[str, Any]:
    return {"prompts_sha256": sha, "failed": failed, **{k: scale * (i + 1) for i, k in enumerate(THROUGHPUT_KEYS)}}


def test_ratio_and_refusals() -> None:
    serving, offline = _report(0.93), _report(1.0)
    cmp = vs_offline(serving, offline, "off.json")
    assert all(cmp["ratio"][k] == pytest.approx(0.93) for k in THROUGHPUT_KEYS)
    assert cmp["meets_target"] and cmp["offline_file"] == "off.json"
    assert not vs_offline(_report(0.85), offline)["meets_target"]
    with pytest.raises(SglxError, match="other prompts"):
        vs_offline(serving, _report(1.0, sha="def"))
    with pytest.raises(SglxError, match="2 failed"):
        vs_offline(serving, _report(1.0, failed=2))
    with pytest.raises(SglxError, match="lacks prompts_sha256"):
        vs_offline(serving, {"request_throughput": 1.0})
    with pytest.raises(SglxError, match="--endpoint chat"):
        vs_offline({**serving, "config": {"endpoint": "chat"}}, offline)
    with pytest.raises(SglxError, match="--ignore-eos"):
        vs_offline({**serving, "config": {"ignore_eos": False}}, {**offline, "config": {"ignore_eos": True}})


def test_percentiles_against_nearest_rank() -> None:
    values = [random.Random(4).random() for _ in range(50)]
    ordered = sorted(values)
    s = _stats(values)
    assert s["p90_ms"] == pytest.approx(ordered[44] * 1e3)  # ceil(0.9 * 50) = 45th value
    assert s["p99_ms"] == pytest.approx(ordered[49] * 1e3)
    assert s["median_ms"] <= s["p90_ms"] <= s["p99_ms"]


def test_unreadable_offline_result_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    result = CliRunner().invoke(app, ["bench", "serving", "--offline-result", str(bad), "--num-prompts", "1"])
    assert result.exit_code == 2 and "--offline-result" in result.output


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = start_server(model, tmp_path_factory.mktemp("offline_logs"))
    yield proc
    proc.stop()


def test_serving_against_offline_on_the_same_requests(server: ServerProcess, model: Path, engine: Any,
                                                      tmp_path: Path) -> None:
    dataset = ["--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "5",
               "--random-range-ratio", "0.5", "--seed", "3"]
    offline_file = tmp_path / "offline.json"
    result = CliRunner().invoke(app, ["bench", "offline-throughput", *dataset, "--model-path", str(model),
                                      *ENGINE_ARGS, "--output-file", str(offline_file)])
    assert result.exit_code == 0, result.output
    offline = json.loads(offline_file.read_text())
    assert offline["completed"] == 6 and offline["engine"]["device"] == "cpu"
    result = CliRunner().invoke(app, ["bench", "serving", "--base-url", server.base_url, *dataset,
                                      "--disable-progress", "--offline-result", str(offline_file), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prompts_sha256"] == offline["prompts_sha256"]
    assert report["total_output_tokens"] == offline["total_output_tokens"]
    assert report["total_input_tokens"] == offline["total_input_tokens"]
    ratio = report["vs_offline"]["ratio"]["output_token_throughput"]
    assert ratio == pytest.approx(report["output_token_throughput"] / offline["output_token_throughput"])
    for key in ("ttft", "itl"):
        assert 0 < report[key]["median_ms"] <= report[key]["p90_ms"] <= report[key]["p99_ms"]
    assert "/ offline engine" in _render(report)

    # the server answers the offline prompts with the engine's own greedy tokens (official client)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    cfg = OfflineBenchConfig(**DATASET)
    prompts = offline_prompts(cfg, engine.model_config.vocab_size)[:2]
    direct = engine.generate(input_ids=[p.prompt for p in prompts],
                             sampling_params=[sampling_params(cfg, p) for p in prompts])
    for p, want in zip(prompts, direct):
        got = client.completions.create(model=report["model"], prompt=p.prompt, max_tokens=p.output_len,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == want["completion_tokens"] == p.output_len
        assert got.choices[0].text == want["text"]


def _render(report: dict[str, Any]) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(report_table(report))
    return console.export_text()
