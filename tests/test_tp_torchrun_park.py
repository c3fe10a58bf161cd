"""Tensor-parallel ranks started by torchrun (RANK / WORLD_SIZE / MASTER_* in the environment, no sglx spawn)
park when idle like sglx's own workers: idle past the collective timeout, the group still serves, in step."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.distributed.spawn import spawn_workers
from tp_park_workers import torchrun_engine_idles

PROMPT = [1, 5, 9, 33, 70, 100, 200, 7]
STEPS = 6
TIMEOUT_S = 6  # every collective of the group times out after 6 s; the driver parks its workers after 1.5 s idle
IDLE_S = 8.0


def test_torchrun_launched_tp_group_survives_idling_past_the_timeout(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx import platform

    monkeypatch.setenv("SGLX_DIST_TIMEOUT", str(TIMEOUT_S))  # inherited by both ranks
    path = make_tiny_model(tmp_path, "llama")
    want = hf_greedy(load_hf_model(path), PROMPT, STEPS)[0]
    rank0, rank1 = spawn_workers(torchrun_engine_idles, 2, (str(path), PROMPT, STEPS, IDLE_S, platform.current()),
                                 timeout_s=180)
    assert rank1 == {"rank": 1, "exit": 0}  # the worker left when rank 0 shut down, not on a timeout
    assert rank0["spawned"] == "_LauncherWorkers"  # torchrun's ranks: sglx spawned nothing
    assert rank0["parks"] >= 1  # the idle worker waited in the store, outside any collective
    assert rank0["first"] == want and rank0["second"] == want  # woken, in step: HF's greedy tokens both times
