"""`sglx serve --tp-size 2` (gloo, CPU): idle longer than the collective timeout, the group still serves (the
driver parks its workers outside any collective); a worker rank killed turns /health into 503 with the failure's
one line, and the server still stops with no rank left behind."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

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


def _complete(base_url: str) -> str:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=60,
                      json={"prompt": "hello there", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_idle_tp_group_survives_and_health_reports_a_dead_rank(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLX_DIST_TIMEOUT", "12")  # collectives time out after 12 s; workers park after 3 s idle
    model = make_tiny_model(tmp_path, "llama")
    server = ServerProcess(model, log_dir=tmp_path, engine_args=ENGINE_ARGS).wait_ready(timeout=180)
    try:
        ok = httpx.get(f"{server.base_url}/health", timeout=10)
        assert ok.status_code == 200 and ok.json() == {"status": "ok"}
        first = _complete(server.base_url)
        time.sleep(16)  # idle past the timeout: a worker waiting in a broadcast would have failed by now
        ok = httpx.get(f"{server.base_url}/health", timeout=10)
        assert ok.status_code == 200, ok.text
        assert _complete(server.base_url) == first  # woken, in step: the same greedy text
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
