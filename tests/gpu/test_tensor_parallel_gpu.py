"""Tensor parallelism on 2 GPUs with NCCL: the CPU tier's checks (tests/test_tensor_parallel.py) on CUDA.

Not yet run on a GPU (written on a CPU-only session; no multi-GPU machine was lent). Run on the lent
nvidia-h200-x2: PYTHONPATH=src:tests python3 -m pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py -q
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

PROMPTS = [[1, 5, 9, 33, 70, 100, 200, 7, 12, 64, 3], [1, 44, 45, 46, 47, 48, 302, 17, 250]]
STEPS = 12
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from llm_test_utils import make_tiny_model

    root = tmp_path_factory.mktemp("tp_gpu_models")
    return {"gqa": make_tiny_model(root, "llama"),
            "one_kv": make_tiny_model(root, "qwen3", seed=1, num_key_value_heads=1)}


def nccl_facts(rank: int, world_size: int) -> tuple[str, float, str, str]:
    from sglx.distributed import init_distributed

    ctx = init_distributed()
    t = torch.full((4,), float(rank + 1), device=ctx.device)
    ctx.all_reduce(t)
    return ctx.backend, float(t[0]), str(ctx.device), os.environ.get("NCCL_NVLS_ENABLE", "")


def test_nccl_group_one_gpu_per_rank_multicast_off() -> None:
    from sglx.distributed import spawn_workers

    results = spawn_workers(nccl_facts, 2, timeout_s=120)
    assert results == [("nccl", 3.0, "cuda:0", "0"), ("nccl", 3.0, "cuda:1", "0")]


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_tp2_logits_match_tp1_on_cuda(models: dict[str, Path], backend: str) -> None:
    from sglx import platform
    from sglx.distributed import spawn_workers
    from sglx.llm.model_runner import ModelRunner
    from tp_workers import prompt_logits, runner_config, tp_logits_worker

    prompt, nxt = PROMPTS[0], 77
    paths = [str(models["gqa"]), str(models["one_kv"])]
    ranks = spawn_workers(tp_logits_worker, 2, (paths, prompt, nxt, "cuda", backend, platform.current()),
                          timeout_s=300)
    for i, path in enumerate(paths):
        assert torch.equal(ranks[0][i][0], ranks[1][i][0]) and torch.equal(ranks[0][i][1], ranks[1][i][1])
        with torch.inference_mode():
            runner = ModelRunner(runner_config(path, "cuda", 1, backend))
            ref = prompt_logits(runner, prompt, nxt)
            runner.release_memory()
        torch.testing.assert_close(ranks[0][i][0], ref[0], atol=1e-3, rtol=0)
        torch.testing.assert_close(ranks[0][i][1], ref[1], atol=1e-3, rtol=0)


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_tp2_greedy_matches_hf_on_cuda(models: dict[str, Path], graphs: bool) -> None:
    from llm_test_utils import hf_greedy, load_hf_model
    from sglx.llm.engine import Engine

    path = models["gqa"]
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]
    with Engine(model_path=str(path), device="cuda", dtype="float32", attention_backend="triton", tp_size=2,
                max_total_tokens=4096, disable_cuda_graph=not graphs) as eng:
        assert eng.info["tp_size"] == 2 and eng.info["cuda_graph"] == graphs
        results = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == refs


def test_a_dying_rank_ends_the_nccl_engine_with_one_line(models: dict[str, Path]) -> None:
    from sglx.errors import SglxError
    from sglx.llm.engine import Engine

    eng = Engine(model_path=str(models["gqa"]), device="cuda", dtype="float32", attention_backend="triton",
                 tp_size=2, max_total_tokens=4096)
    try:
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        (proc,) = eng.runner.tp_driver.workers._procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(SglxError, match="rank 1 of 2"):
            for _ in range(100):
                eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
                time.sleep(0.1)
        assert time.monotonic() - started < 60
    finally:
        eng.shutdown()
    assert not proc.is_alive()


def test_tp_more_ranks_than_gpus_is_one_line() -> None:
    from sglx.errors import SglxError
    from sglx.llm.engine import Engine

    n = torch.cuda.device_count()
    with pytest.raises(SglxError, match=f"needs {2 * n} GPUs but this machine has {n}"):
        Engine(model_path="llama-3.2-1b", load_format="dummy", device="cuda", tp_size=2 * n)


def test_dp_replicas_get_disjoint_gpu_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.errors import SglxError
    from sglx.server.dp_router import replica_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    n = torch.cuda.device_count()
    assert replica_gpus(2, 1) == ["0", "1"]
    assert replica_gpus(1, 2) == ["0,1"]
    with pytest.raises(SglxError, match=f"needs {n + 1} GPUs but {n} are visible"):
        replica_gpus(n + 1, 1)
