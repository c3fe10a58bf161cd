"""Run one module of interpreted Triton cases in a child pytest with TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_interpreted(module: str, timeout: float = 300.0) -> None:
    """Fail with the child's report unless every case in `module` passed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / module)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    report = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"interpreted Triton cases failed ({' '.join(cmd[2:])}):\n{report}"
    assert " passed" in report and "skipped" not in report, report
