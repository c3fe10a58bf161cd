"""Run `sglx serve` as a real subprocess on a free loopback port, for the server and bench tests.

The model is the one embedded in sglx when its weights are present (what `sglx serve` serves by
default), else a tiny random Llama saved to a temp dir, so the tests run before the embedded model
lands too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from llm_test_utils import make_tiny_model
from sglx.llm.embedded import default_model_path

# Small, fixed engine sizes: the same KV pool on every machine, and little memory.
ENGINE_ARGS = ("--max-total-tokens", "16384", "--max-running-requests", "64", "--dtype", "float32")


def model_path(tmp_dir: Path) -> Path:
    embedded = default_model_path()
    if (embedded / "model.safetensors").is_file() and (embedded / "tokenizer.json").is_file():
        return embedded
    return make_tiny_model(tmp_dir, "llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m sglx serve ...` on 127.0.0.1:<free port>; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, model: Path, *extra: str, log_dir: Path, engine_args: tuple[str, ...] = ENGINE_ARGS) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("SGLX_API_KEY", None)
        self.args = [sys.executable, "-m", "sglx", "serve", "--model-path", str(model), "--port", str(self.port),
                     *engine_args, *extra]
        self.signalled = False
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sglx serve did not become healthy in {timeout}s:\n{self.log()}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send a signal once; stop() then only waits (a second SIGTERM would kill a server that is draining)."""
        self.signalled = True
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            if not self.signalled:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def engine_processes(server_pid: int) -> list[Any]:
    """The server's engine process(es) (`python -m sglx.server.engine_process`), as psutil processes."""
    import psutil

    return [c for c in psutil.Process(server_pid).children(recursive=True)
            if "sglx.server.engine_process" in " ".join(c.cmdline())]


def start_server(model: Path, log_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess(model, *extra, log_dir=log_dir).wait_ready()


def engine_load(base_url: str, headers: dict[str, str] | None = None) -> dict[str, int]:
    """Running/queued requests and KV pool numbers from /server_info."""
    info = httpx.get(f"{base_url}/server_info", headers=headers, timeout=30).json()
    return {**info["scheduler"], **{f"kv_{k}": v for k, v in info["kv_pool"].items()}}


def wait_idle(base_url: str, headers: dict[str, str] | None = None, timeout: float = 20.0) -> dict[str, int]:
    """Poll until no request runs or waits and no KV slot is held by a request; returns the last reading."""
    deadline = time.monotonic() + timeout
    load = engine_load(base_url, headers)
    while time.monotonic() < deadline:
        if load["running_requests"] == 0 and load["queued_requests"] == 0 and load["kv_used"] == 0:
            return load
        time.sleep(0.1)
        load = engine_load(base_url, headers)
    return load
