"""A broken tensor-parallel group is visible on /health: `sglx serve --tp-size 2` (gloo, CPU) whose worker rank
is killed answers 503 with the failure's one line, and the server still stops with no rank left behind."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psutil

from llm_test_utils import make_tiny_model
from server_test_utils import ServerProcess

ENGINE_ARGS = ("--max-total-tokens", "512", "--max-running-requests", "8", "--dtype", "float32", "--device", "cpu",
               "--attention-backend", "torch_native", "--tp-size", "2")


def _worker_ranks(pid: int) -> list[psutil.Process]:
    """The server's spawned rank processes (not multiprocessing's resource tracker)."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        cmd = " ".join(child.cmdline())
        if "multiprocessing.spawn" in cmd or "spawn_main" in cmd:
            out.append(child)
    return out


def test_health_reports_a_dead_tp_rank(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama")
    server = ServerProcess(model, log_dir=tmp_path, engine_args=ENGINE_ARGS).wait_ready(timeout=180)
    try:
        ok = httpx.get(f"{server.base_url}/health", timeout=10)
        assert ok.status_code == 200 and ok.json() == {"status": "ok"}
        children = psutil.Process(server.proc.pid).children(recursive=True)
        (rank1,) = _worker_ranks(server.proc.pid)
        rank1.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        resp = httpx.get(f"{server.base_url}/health", timeout=10)
        while resp.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            resp = httpx.get(f"{server.base_url}/health", timeout=10)
        assert resp.status_code == 503, resp.text
        body = resp.json()
        assert body["status"] == "unavailable", body
        assert "rank 1 of 2" in body["error"] and "SIGKILL" in body["error"] and "\n" not in body["error"], body
    finally:
        server.stop(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, alive  # no rank (or helper process) outlives the server
