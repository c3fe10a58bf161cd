"""`sglx doctor` on this CPU machine: through typer's CliRunner and through a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from sglx.cli.app import app

CUDA_ONLY = ("flashinfer", "fa3", "fa4", "trtllm_mha", "dual_chunk_flash_attn")


def _section(report: dict, kind: str) -> dict:
    return next(s for s in report["sections"] if s["kind"] == kind)


def _row(section: dict, name: str) -> dict:
    return next(r for r in section["backends"] if r["name"] == name)


def test_doctor_json_cli_runner() -> None:
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["machine"]["device_kind"] == "cpu"
    mha = _section(report, "mha")
    assert _row(mha, "torch_native")["usable"] is True
    for name in CUDA_ONLY:
        row = _row(mha, name)
        assert row["usable"] is False
        assert any("CUDA" in r for r in row["reasons"]), row
    dit = _section(report, "dit")
    assert _row(dit, "torch_sdpa")["usable"] is True
    assert _row(dit, "fa")["usable"] is False
    assert mha["auto"]["backend"] == "torch_native"
    assert dit["auto"]["backend"] == "torch_sdpa"
    mla = _section(report, "mla")
    assert mla["auto"]["backend"] == "torch_native" and _row(mla, "torch_native")["usable"] is True


def test_doctor_family_filter() -> None:
    result = CliRunner().invoke(app, ["doctor", "--json", "--family", "diffusion"])
    assert result.exit_code == 0
    kinds = [s["kind"] for s in json.loads(result.output)["sections"]]
    assert kinds == ["dit"]


def test_doctor_check_runs_backends_in_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "sglx", "doctor", "--check", "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    checks = {(c["kind"], c["backend"]): c for s in report["sections"] for c in s.get("checks", [])}
    assert checks[("dit", "torch_sdpa")]["status"] == "pass"
    for kind in ("mha", "mla"):  # the MLA check: expanded extend and absorbed decode vs float64
        assert checks[(kind, "torch_native")]["status"] == "pass"
        assert checks[(kind, "torch_native")]["max_abs_error"] < 1e-4
    assert "MLA" in checks[("mla", "torch_native")]["problem"]


def test_doctor_rich_output_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "sglx", "doctor"], capture_output=True, text=True,
                          timeout=300, check=False, env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "torch_native" in proc.stdout
    assert "runs on CUDA only" in proc.stdout
    assert "pip install 'sglx[flashinfer]'" in proc.stdout


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith("sglx ")
