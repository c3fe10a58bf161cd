"""`sglx bench attention` on a CPU: tiny default shapes, torch_native and flex_attention against SDPA and float64.

The JSON report is checked against quantities computed here independently (FLOPs, K/V bytes,
ratios), a broken backend must be reported as wrong (not timed) with exit code 1, and bad flags are
usage errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sglx.cli.app import app

FAST = ("--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1")


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def bench(tmp_path: Path, *args: str) -> tuple[object, dict | None]:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", "attention", *FAST, "--output", str(out), *args])
    return result, json.loads(out.read_text()) if out.exists() else None


def rows(case: dict) -> dict[str, dict]:
    return {r["kind"] if r["kind"] != "sglx" else r["backend"]: r for r in case["rows"]}


def test_default_cpu_suite_checks_and_times_torch_native_against_sdpa(tmp_path: Path) -> None:
    result, report = bench(tmp_path)
    assert result.exit_code == 0, result.output
    assert "torch_native" in result.stdout and "sdpa" in result.stdout  # the rich table
    assert report["environment"]["device"] == "cpu" and report["flashinfer"] == "not tried on CPU"
    cases = report["cases"]
    shapes = [(c["case"]["phase"], c["case"]["prefix"], c["case"]["new"], c["case"]["page_size"]) for c in cases]
    assert shapes == [("decode", 63, 1, 1), ("decode", 63, 1, 16), ("prefill", 0, 32, 16), ("prefill", 32, 8, 16)]
    for c in cases:
        shape = c["case"]
        by = rows(c)
        assert set(by) == {"sdpa", "torch_native", "flex_attention"}  # triton cannot run on a CPU: left out
        ours, sdpa = by["torch_native"], by["sdpa"]
        for r in (ours, sdpa, by["flex_attention"]):
            assert r["ok"] and 0 <= r["max_abs_err"] <= r["tolerance"] == 1e-4 and r["median_ms"] > 0
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["runs"] >= 3
        assert ours["time_ratio"]["sdpa"] == pytest.approx(ours["median_ms"] / sdpa["median_ms"])
        b, hq, hkv, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
        if shape["phase"] == "decode":
            kv_bytes = 2 * b * 64 * hkv * d * 4  # context 64, float32
            assert ours["gb_per_s"] == pytest.approx(kv_bytes / (ours["median_ms"] * 1e-3) / 1e9)
        else:
            p, n = shape["prefix"], shape["new"]
            visible = sum(p + i + 1 for i in range(n))  # causal: query i sees prefix + i + 1 keys
            flops = 4 * b * hq * d * visible
            assert ours["tflops"] == pytest.approx(flops / (ours["median_ms"] * 1e-3) / 1e12)
    assert report["failed"] == []


def test_fp8_kv_and_explicit_backends(tmp_path: Path) -> None:
    result, report = bench(tmp_path, "--phase", "decode", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "4",
                           "--context-len", "40", "--backend", "torch_native", "--backend", "triton",
                           "--num-q-heads", "8", "--num-kv-heads", "2", "--head-dim", "32", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cases"] == report["cases"]
    (case,) = report["cases"]
    assert case["case"]["kv_cache_dtype"] == "fp8_e4m3" and case["case"]["context"] == 40
    by = rows(case)
    assert "CPU" in by["triton"]["skipped"]  # asked for explicitly: says why it did not run
    ours = by["torch_native"]
    assert ours["ok"] and ours["max_abs_err"] <= 1e-4  # against float64 on the dequantized fp8 keys
    kv_bytes = 2 * 2 * 40 * 2 * 32 * 1  # fp8: one byte per element
    assert ours["gb_per_s"] == pytest.approx(kv_bytes / (ours["median_ms"] * 1e-3) / 1e9)


def test_a_wrong_backend_is_reported_not_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.attention.llm.torch_native import TorchNativeBackend

    real = TorchNativeBackend.forward_decode

    def off_by_a_bit(self, *args, **kwargs):
        return real(self, *args, **kwargs) * 1.01

    monkeypatch.setattr(TorchNativeBackend, "forward_decode", off_by_a_bit)
    result, report = bench(tmp_path, "--phase", "decode", "--page-size", "1", "--no-baselines",
                           "--backend", "torch_native")
    assert result.exit_code == 1
    (case,) = report["cases"]
    (row,) = case["rows"]
    assert not row["ok"] and "median_ms" not in row and row["max_abs_err"] > 1e-4
    assert "wrong result" in row["error"] and report["failed"]


@pytest.mark.parametrize("args,message", [
    (("--prefill-shape", "4096"), "write PREFIX:NEW"),
    (("--backend", "dual_chunk_flash_attn"), "not implemented in sglx yet"),
    (("--num-q-heads", "6", "--num-kv-heads", "4"), "not a multiple"),
    (("--context-len", "0"), "--context-len 0"),
    (("--cuda-graph",), "needs a CUDA device"),
])
def test_bad_options_are_usage_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    result, report = bench(tmp_path, *args)
    assert result.exit_code == 2 and message in result.output and report is None
    assert "Traceback" not in result.output
