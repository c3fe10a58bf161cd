"""`sglx bench diffusion` on CPU: tiny shapes and a 2-layer Wan step, checked before timed, as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sglx.cli.app import app

pytest.importorskip("diffusers")
FAST = ["--device", "cpu", "--warmup-ms", "0", "--rep-ms", "1"]


def test_attention_and_step_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "diffusion", *FAST, "--tiny", "--num-frames", "5", "--height", "32",
                                      "--width", "48", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    shapes = {c["shape"]["key"]: c for c in report["attention"]}
    assert set(shapes) == {"tiny-video", "tiny-joint"}
    assert shapes["tiny-joint"]["tokens"] == 8 * 9 + 29
    for case in report["attention"]:
        row = next(r for r in case["rows"] if r["backend"] == "torch_sdpa")
        assert row["ok"] and row["max_abs_err"] < 1e-4 and row["median_ms"] > 0
    step = report["step"]
    assert step["latent"] == [1, 4, 2, 4, 6] and step["tokens"] == 2 * 2 * 3
    sglx = [r for r in step["rows"] if r["side"] == "sglx"]
    assert [r["fused_kernels"] for r in sglx] == [True, False]
    assert all(r["rel_l2_vs_baseline"] < 1e-4 for r in sglx)  # same numbers as diffusers' own forward
    assert step["baseline"] in {r["attention"] for r in step["rows"] if r["side"] == "diffusers" and "median_ms" in r}
    assert report["summary"]["sglx / diffusers step time"] == pytest.approx(step["sglx_over_diffusers"], abs=1e-3)


@pytest.mark.parametrize(("args", "needle"), [
    (["--attention-only", "--step-only"], "exclude each other"),
    (["--step-only", "--num-frames", "6"], "4k+1 frames"),
    (["--attention-only", "--backend", "fa"], "--backend fa cannot run here"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["bench", "diffusion", *FAST, "--tiny", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
