"""Tensor parallelism on the CPU: 2 processes over gloo, checked against Hugging Face transformers and tp 1.

Each test that starts ranks pays for Python + torch start-ups, so the checks are grouped: one pair of
processes runs `sglx generate --tp 2` under torchrun's variables and then the model-level logits (two
models: KV heads split, and one KV head replicated on both ranks); one engine (sglx's own spawn) checks
greedy tokens, sampling and a rank dying mid-run; one more checks rank 0 failing mid-step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.cli.app import app
from sglx.distributed import WorkerError, spawn_workers
from sglx.errors import SglxError
from sglx.llm.engine import Engine
from tp_workers import prompt_logits, raise_mid_run_worker, runner_config, torchrun_generate_then_logits

PROMPTS = [[1, 5, 9, 33, 70, 100, 200, 7, 12, 64, 3], [1, 44, 45, 46, 47, 48, 302, 17, 250]]
STEPS = 10
GREEDY = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
LOGIT_ATOL = 1e-4  # float32: two partial sums all-reduced instead of one sum


def ended(proc: object, timeout_s: float) -> bool:
    """The worker process is gone within `timeout_s`. Polled, not joined: the group's own threads reap it too,
    and a join racing that reap loses its waitpid (ECHILD), after which multiprocessing reports "alive" once."""
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.1)
    return not proc.is_alive()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llamas with 4 query heads: 2 KV heads (split 1 + 1) and 1 KV head (replicated on both ranks)."""
    root = tmp_path_factory.mktemp("tp_models")
    return {"gqa": make_tiny_model(root, "llama"),
            "one_kv": make_tiny_model(root, "llama", seed=1, num_key_value_heads=1, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def hf_refs(models: dict[str, Path]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    refs = {}
    for name, path in models.items():
        hf = load_hf_model(path)
        refs[name] = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    return refs


def test_tp2_generate_under_torchrun_env_and_logits_match_tp1_and_hf(models: dict[str, Path],
                                                                      single_torch_thread: None) -> None:
    """Two ranks with torchrun's variables run `sglx generate ... --tp 2` (rank 0 prints HF's greedy tokens,
    rank 1 serves it and exits 0); then the same two processes build each model's shards directly and compare
    their logits with tp 1 and HF (KV heads split 1 + 1, and one KV head replicated on both ranks)."""
    from sglx import platform
    from sglx.distributed import find_free_port
    from sglx.llm.model_runner import ModelRunner
    from sglx.llm.tokenizer import Tokenizer

    gen_path = models["one_kv"]
    text = "The quick brown fox"
    ref_tokens = hf_greedy(load_hf_model(gen_path), Tokenizer.from_dir(gen_path).encode(text), 8)[0]
    args = ["--model-path", str(gen_path), "--prompt", text, "--max-new-tokens", "8", "--ignore-eos", "--json",
            "--dtype", "float32", "--tp", "2", "--max-total-tokens", "512"]
    prompt, nxt = PROMPTS[0], 77
    paths = [str(models["gqa"]), str(models["one_kv"])]
    (code0, out0, logits0), (code1, out1, logits1) = spawn_workers(
        torchrun_generate_then_logits, 2, (args, platform.current(), paths, prompt, nxt, find_free_port()),
        timeout_s=240)

    assert code0 == 0 and code1 == 0, (out0, out1)
    (record,) = [json.loads(line) for line in out0.splitlines() if line.startswith("{")]
    assert record["output_ids"] == ref_tokens
    assert out1.strip() == ""

    for i, path in enumerate(paths):
        extend0, decode0 = logits0[i]
        extend1, decode1 = logits1[i]
        # every rank ends with the same full-vocabulary logits (the LM head gathers them): same sampling
        assert torch.equal(extend0, extend1) and torch.equal(decode0, decode1)
        with torch.inference_mode():
            runner = ModelRunner(runner_config(path))
            extend_tp1, decode_tp1 = prompt_logits(runner, prompt, nxt)
        torch.testing.assert_close(extend0, extend_tp1, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(decode0, decode_tp1, atol=LOGIT_ATOL, rtol=0)
        hf = load_hf_model(Path(path))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + [nxt]])).logits[0].float()
        torch.testing.assert_close(extend0, ref[:-1], atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(decode0[0], ref[-1], atol=LOGIT_ATOL, rtol=0)


def test_engine_tp2_greedy_sampling_and_a_dying_rank(models: dict[str, Path],
                                                     hf_refs: dict[str, list[tuple[list[int], torch.Tensor]]]) -> None:
    path = models["gqa"]
    sampled = {"max_new_tokens": STEPS, "temperature": 0.9, "top_k": 50, "seed": 7, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=4,
                attention_backend="torch_native") as tp1:
        sampled_tp1 = tp1.generate(input_ids=PROMPTS, sampling_params=sampled)
    eng = Engine(model_path=str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=4,
                 attention_backend="torch_native", tp_size=2)
    try:
        assert eng.info["tp_size"] == 2
        # batched, chunked prefill (chunks of 4), then decodes; the second call hits the radix cache
        for _ in range(2):
            results = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == [ref[0] for ref in hf_refs["gqa"]]
        # sampling runs once, in rank 0, on logits equal to tp 1's: the same seed gives the same tokens
        assert [r["output_ids"] for r in eng.generate(input_ids=PROMPTS, sampling_params=sampled)] == \
            [r["output_ids"] for r in sampled_tp1]

        # a worker rank dies (as under the OOM killer): the next request fails with one line, no hang
        workers = eng.runner.tp_driver.workers
        (proc,) = workers._procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(SglxError) as info:
            for _ in range(50):  # the watcher notices within a fraction of a second
                eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
                time.sleep(0.1)
        assert time.monotonic() - started < 30
        message = str(info.value)
        assert "rank 1 of 2" in message and "SIGKILL" in message and "\n" not in message
    finally:
        eng.shutdown()
    assert ended(proc, 5)


def test_rank_0_failing_mid_step_stops_the_group(models: dict[str, Path]) -> None:
    """Rank 0 raising after the workers began the step (e.g. out of memory): their collectives can never match
    again, so the workers are ended and every request after gets the same one line."""
    eng = Engine(model_path=str(models["one_kv"]), dtype="float32", max_total_tokens=512, tp_size=2)
    try:
        (proc,) = eng.runner.tp_driver.workers._procs.values()

        def out_of_memory(batch: object) -> torch.Tensor:
            raise RuntimeError("CUDA out of memory (simulated)\ndetails")

        eng.runner._forward = out_of_memory  # rank 0's own compute; the step was already sent to rank 1
        for _ in range(2):
            with pytest.raises(SglxError) as info:
                eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
            assert str(info.value) == ("rank 0 of 2 failed: RuntimeError: CUDA out of memory (simulated) "
                                       "(the tensor-parallel group was stopped)")
        assert ended(proc, 15)
    finally:
        eng.shutdown()


@pytest.mark.parametrize(("args", "message"), [
    (["--tp-size", "3"], "4 attention heads do not split over 3 ranks"),
    (["--tp", "0"], "--tp-size 0: must be an integer >= 1"),  # (the engine-options error format: a list)
    (["--tp-size", "2", "--device", "cuda"], "CUDA is not available"),
])
def test_bad_tp_is_one_line_exit_2(models: dict[str, Path], args: list[str], message: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(app, ["generate", "--model-path", str(models["gqa"]), "--prompt", "x", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    if "--tp" not in args:
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_tp_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(SglxError, match="not supported for MLA/MoE"):
        Engine(model_path="deepseek-v2-lite", load_format="dummy", tp_size=2, device="cpu")


def test_bench_one_batch_tp2_is_rejected_before_loading_when_heads_do_not_split(models: dict[str, Path]) -> None:
    from sglx.bench.one_batch import OneBatchConfig, run_one_batch
    from sglx.llm.engine_config import EngineConfig

    with pytest.raises(SglxError, match="do not split over 3 ranks"):
        run_one_batch(EngineConfig(model_path=str(models["gqa"]), tp_size=3), OneBatchConfig())


def test_a_rank_raising_mid_run_ends_every_rank_with_one_line() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn_workers(raise_mid_run_worker, 2, timeout_s=60)
    assert time.monotonic() - started < 60
    assert str(info.value) == "rank 1 of 2 failed: ValueError: rank 1 gave up on purpose"
    assert info.value.rank == 1 and "Traceback" in info.value.details
