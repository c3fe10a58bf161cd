"""`sglx serve` runs its engine in a child process: if that process dies mid-request the clients get clean errors
(a 500 JSON body, an error event then [DONE] in a stream), /health stops answering 200 and the server exits 1 on its
own; if the server dies (SIGKILL), the engine process goes with it. (A graceful SIGTERM taking the engine process
down is checked in test_server.py's SIGTERM test.)"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from server_test_utils import engine_processes, start_server
from server_test_utils import model_path as pick_model

PROMPT = "k3=abcd; k7=efgh; k12=wxyz; ? k7="


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pick_model(tmp_path_factory.mktemp("engine_process_model"))


def test_engine_process_crash_fails_requests_cleanly_and_stops_the_server(model: Path, tmp_path: Path) -> None:
    proc = start_server(model, tmp_path, "--max-running-requests", "2")
    try:
        (engine,) = engine_processes(proc.proc.pid)
        streamed: list[str] = []
        plain: dict[str, Any] = {}
        body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{proc.base_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        streamed.append(line[6:])
                        if len(streamed) == 3:
                            engine.send_signal(signal.SIGKILL)  # mid-stream, a non-streamed request waiting too

        def non_streamed() -> None:
            resp = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=60)
            plain.update(status=resp.status_code, body=resp.json())

        waiting = threading.Thread(target=non_streamed)
        waiting.start()
        stream()
        waiting.join(60)
        assert not waiting.is_alive()
        assert streamed[-1] == "[DONE]", streamed[-3:]
        error = json.loads(streamed[-2])["error"]
        assert "engine process was killed by SIGKILL" in error["message"], error
        assert plain["status"] == 500, plain
        assert "engine process was killed by SIGKILL" in plain["body"]["error"]["message"], plain
        code = proc.proc.wait(30)  # the server stops by itself, no signal needed
    finally:
        code = proc.stop(timeout=30)
    assert code == 1, proc.log()
    log = proc.log()
    assert "[sglx] error: the engine process was killed by SIGKILL" in log, log[-2000:]
    assert "Traceback" not in log and "leaked semaphore" not in log, log[-3000:]


def test_engine_process_exits_when_the_server_is_killed(model: Path, tmp_path: Path) -> None:
    proc = start_server(model, tmp_path)
    try:
        (engine,) = engine_processes(proc.proc.pid)
        ok = httpx.post(f"{proc.base_url}/v1/completions", timeout=60,
                        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0})
        assert ok.status_code == 200, ok.text
        proc.proc.kill()  # no chance to clean up: the kernel's parent-death signal must end the engine
        proc.proc.wait(10)
        started = time.monotonic()
        _, alive = psutil.wait_procs([engine], timeout=20)
        assert not alive, "the engine process outlived a killed server"
        assert time.monotonic() - started < 15
    finally:
        proc.stop(timeout=10)
