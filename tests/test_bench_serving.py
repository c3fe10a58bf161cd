"""`sglx bench serving` against a real `sglx serve`: the JSON report and table, token counts that match what
was asked, Poisson and concurrency modes, failures counted; plus its length and percentile helpers."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from server_test_utils import ServerProcess, start_server, wait_idle
from server_test_utils import model_path as pick_model
from sglx.bench.serving import RequestOutcome, ServingBenchConfig, build_prompts, draw_lengths, summarize
from sglx.cli.app import app
from sglx.errors import SglxError


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = pick_model(tmp_path_factory.mktemp("bench_model"))
    proc = start_server(model, tmp_path_factory.mktemp("bench_logs"))
    yield proc
    proc.stop()


def bench(*args: str) -> Any:
    return CliRunner().invoke(app, ["bench", "serving", "--disable-progress", *args])


def test_json_report_with_max_concurrency(server: ServerProcess) -> None:
    result = bench("--base-url", server.base_url, "--num-prompts", "24", "--max-concurrency", "6",
                   "--random-input-len", "40", "--random-output-len", "8", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["completed"] == 24 and report["failed"] == 0 and report["errors"] == []
    assert report["total_output_tokens"] == 24 * 8  # ignore_eos + fixed lengths: exactly what was asked
    assert report["total_input_tokens"] == 24 * 40  # token-id prompts: exact input lengths (server's usage)
    assert report["peak_concurrency"] == 6
    assert report["model"] == Path(server.args[server.args.index("--model-path") + 1]).name
    for key in ("ttft", "itl", "e2e_latency"):
        s = report[key]
        assert 0 < s["median_ms"] <= s["p99_ms"] and s["mean_ms"] > 0
    assert report["e2e_latency"]["median_ms"] >= report["ttft"]["median_ms"]
    assert report["output_token_throughput"] == pytest.approx(report["total_output_tokens"] / report["duration_s"])
    assert report["request_throughput"] == pytest.approx(24 / report["duration_s"])
    assert wait_idle(server.base_url)["kv_used"] == 0


def test_table_report_chat_poisson_with_length_spread(server: ServerProcess, tmp_path: Any) -> None:
    out_file = tmp_path / "report.json"
    args = ["--base-url", server.base_url, "--num-prompts", "16", "--request-rate", "40", "--endpoint", "chat",
            "--random-input-len", "30", "--random-output-len", "10", "--random-range-ratio", "0.3",
            "--length-dist", "normal", "--seed", "5", "--output-file", str(out_file)]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    for label in ("successful requests", "time to first token median", "inter-token latency p99",
                  "end-to-end latency mean", "output token throughput"):
        assert label in result.stdout
    report = json.loads(out_file.read_text())
    assert report["completed"] == 16 and report["config"]["endpoint"] == "chat"
    cfg = ServingBenchConfig(num_prompts=16, input_len=30, output_len=10, range_ratio=0.3, length_dist="normal",
                             seed=5, endpoint="chat")
    assert report["total_output_tokens"] == sum(p.output_len for p in build_prompts(cfg, None))
    assert report["duration_s"] > 0.1  # arrivals spread over ~16/40 s


def test_failures_are_counted_and_exit_nonzero(server: ServerProcess) -> None:
    result = bench("--base-url", server.base_url, "--model", "no-such-model", "--num-prompts", "3",
                   "--random-input-len", "8", "--random-output-len", "2", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["failed"] == 3 and report["completed"] == 0
    assert "HTTP 404" in report["errors"][0]


def test_unreachable_server_is_a_clear_error() -> None:
    result = bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "1")
    assert result.exit_code == 2
    assert "cannot reach http://127.0.0.1:9" in result.output


def test_bad_options_are_usage_errors() -> None:
    result = bench("--num-prompts", "0", "--random-range-ratio", "2")
    assert result.exit_code == 2
    assert "--num-prompts 0" in result.output and "--random-range-ratio 2" in result.output
    with pytest.raises(SglxError, match="token-ids"):
        ServingBenchConfig(endpoint="chat", prompt_kind="token-ids")


# ------------------------------------------------------------------------------------------ helpers


@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_lengths_stay_in_range_and_spread(dist: str) -> None:
    lengths = draw_lengths(random.Random(0), 100, 0.5, dist, 2000)
    assert min(lengths) >= 50 and max(lengths) <= 100
    assert 70 <= statistics.fmean(lengths) <= 80  # centred on the middle of [50, 100]
    assert len(set(lengths)) > 20
    assert draw_lengths(random.Random(0), 100, 1.0, dist, 5) == [100] * 5


def test_prompts_token_ids_text_and_words() -> None:
    cfg = ServingBenchConfig(num_prompts=5, input_len=12, output_len=3)
    ids = build_prompts(cfg, vocab_size=50)
    assert all(isinstance(p.prompt, list) and len(p.prompt) == 12 and max(p.prompt) < 50 for p in ids)
    words = build_prompts(cfg, vocab_size=None)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 12 for p in words)
    assert build_prompts(cfg, 50) == ids  # seeded
    with pytest.raises(SglxError, match="vocabulary size"):
        build_prompts(ServingBenchConfig(prompt_kind="token-ids"), None)


def test_summary_percentiles_against_a_reference() -> None:
    rng = random.Random(1)
    outcomes = [RequestOutcome(success=True, ttft=rng.random(), latency=1 + rng.random(),
                               itl=[rng.random() / 10 for _ in range(5)], prompt_tokens=10, output_tokens=6)
                for _ in range(100)]
    outcomes.append(RequestOutcome(success=False, error="boom"))
    report = summarize(ServingBenchConfig(), "m", outcomes, 2.0, 7)
    ttfts = sorted(o.ttft for o in outcomes[:100])
    assert report["ttft"]["p99_ms"] == pytest.approx(ttfts[98] * 1e3)  # nearest rank: the 99th of 100
    assert report["ttft"]["median_ms"] == pytest.approx((ttfts[49] + ttfts[50]) / 2 * 1e3)
    gaps = [g for o in outcomes[:100] for g in o.itl]
    assert report["itl"]["mean_ms"] == pytest.approx(sum(gaps) / len(gaps) * 1e3)
    assert report["completed"] == 100 and report["failed"] == 1 and report["errors"] == ["boom"]
    assert report["total_token_throughput"] == pytest.approx(1600 / 2.0)
    assert report["config"]["request_rate"] is None and math.isinf(ServingBenchConfig().request_rate)
