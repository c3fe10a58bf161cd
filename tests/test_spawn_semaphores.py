"""Ranks that end by failing (os._exit) or by WorkerGroup.terminate (SIGTERM) release the named semaphores they
made: the resource tracker shared with the parent has nothing left to clean up, so it prints no "leaked semaphore"
warning when the parent exits (it did before spawn.release_semaphores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.mark.parametrize("mode", ["fail", "ok"])
def test_ranks_leave_no_leaked_semaphores(mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(TESTS / "semaphore_workers.py"), mode], capture_output=True, text=True,
                         env=env, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    if mode == "fail":
        assert "error: rank 1 of 2 failed: ValueError: boom" in res.stdout, out
    else:
        assert "['spawn', 'spawn']" in res.stdout, out  # a rank's locks are named semaphores (the spawn method)
    assert "leaked semaphore" not in out, out
