"""Ring attention on 2 GPUs with NCCL through each backend's own LSE kernel: torch_sdpa (memory-efficient
kernel, fp32) and the real fa backend (FA4 / FA3 / FA2, whichever the registry picks; bf16, head dim 64).
The CPU tier (tests/test_ring_lse.py) runs the same cases on gloo with stand-in FA kernels.

Not yet run on a GPU (written on a CPU-only session). Run on the lent nvidia-h200-x2:
PYTHONPATH=src:tests python3 -m pytest -m gpu tests/gpu/test_ring_lse_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from ring_lse_workers import ring_backend_cases
from sglx.distributed.spawn import spawn_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def test_ring2_on_nccl_runs_each_step_on_the_backends_lse_kernel() -> None:
    from sglx import platform
    from sglx.attention.registry import availability, find

    names = ["torch_sdpa"]
    spec = find("fa", "diffusion", "dit")
    if spec is not None and availability(spec, platform.current()).ok:
        names.append("fa")
    res = spawn_workers(ring_backend_cases, 2, (names, "cuda"), timeout_s=300)[0]
    tol = {"torch_sdpa": 1e-3, "fa": 3e-2}  # fp32; bf16 partial outputs merged in fp32
    for name in names:
        r = res[name]
        assert r["own_kernel"] is True and r["kernel_calls"] == 2 and r["warnings"] == [], (name, r)
        assert r["vs_sp1"] < tol[name] and r["vs_f64"] < tol[name], (name, r)
        assert r["text_spread"] == 0.0, (name, r)
    if "fa" not in names:
        pytest.skip("fa cannot run here: only torch_sdpa's ring path was checked")
