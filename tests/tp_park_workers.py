"""Worker function for tests/test_tp_torchrun_park.py: an Engine in a rank started the way torchrun starts one."""

from __future__ import annotations

import time
from typing import Any

import torch


def torchrun_engine_idles(rank: int, world_size: int, model_path: str, prompt: list[int], steps: int,
                          idle_s: float, platform: object) -> dict[str, Any]:
    """Every rank builds `Engine(tp_size=world_size)` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set
    (spawn_workers sets them as torchrun does). Rank 1 serves rank 0 from inside the constructor and leaves with
    SystemExit(0) when rank 0 shuts down; rank 0 generates greedily, idles `idle_s` (past SGLX_DIST_TIMEOUT),
    generates again, and reports both outputs and how many times its workers were parked."""
    import sglx.platform
    from sglx.llm.engine import Engine

    torch.set_num_threads(1)
    sglx.platform.current = lambda probe_packages=True: platform  # type: ignore[assignment]  # seconds per rank
    greedy = {"max_new_tokens": steps, "temperature": 0.0, "ignore_eos": True}
    try:
        engine = Engine(model_path=model_path, dtype="float32", max_total_tokens=256, max_running_requests=4,
                        attention_backend="torch_native", tp_size=world_size, disable_cuda_graph=True)
    except SystemExit as leave:  # a worker rank: it served rank 0 until rank 0 shut down
        return {"rank": rank, "exit": leave.code}
    with engine:
        driver = engine.runner.tp_driver
        first = engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
        time.sleep(idle_s)
        parks = driver._parks
        second = engine.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
    return {"rank": rank, "first": first, "second": second, "parks": parks,
            "spawned": type(driver.workers).__name__}
