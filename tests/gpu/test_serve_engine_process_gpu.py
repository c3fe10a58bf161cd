"""`sglx serve` on CUDA: the engine process (a fresh interpreter, never forked) holds the CUDA context, the HTTP
process none; greedy completions work and SIGTERM leaves no process on the GPU.

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_serve_engine_process_gpu.py -q
Not yet run on a device (written in session 6 without GPU time).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from server_test_utils import engine_processes, model_path, start_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]


def _gpu_pids() -> set[int] | None:
    """Processes with a CUDA context (nvidia-smi), or None where nvidia-smi is missing."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_engine_process_holds_the_gpu_and_the_http_process_does_not(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="sglx serve needs fastapi (a dependency of the installed package)")
    proc = start_server(model_path(tmp_path), tmp_path, "--device", "cuda")
    try:
        (engine,) = engine_processes(proc.proc.pid)
        resp = httpx.post(f"{proc.base_url}/v1/completions", timeout=120,
                          json={"prompt": "k3=abcde; ? k3=", "max_tokens": 6, "temperature": 0.0})
        assert resp.status_code == 200, resp.text
        info = httpx.get(f"{proc.base_url}/server_info", timeout=30).json()
        assert info["engine"]["device"].startswith("cuda"), info["engine"]
        pids = _gpu_pids()
        if pids is not None:  # in a container nvidia-smi may list no pids at all: then only check what it shows
            assert proc.proc.pid not in pids, "the HTTP process created a CUDA context"
            assert engine.pid in pids or not pids, pids
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, proc.log()
    assert not engine.is_running()
