"""`sglx generate` through a real subprocess (text and --json) and typer's runner (usage errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.cli.app import app
from sglx.llm.tokenizer import Tokenizer

PROMPTS = ["The quick brown fox", "Radix trees share the prefix of prompts"]


def sglx(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sglx", "generate", *args], capture_output=True, text=True,
                          timeout=300, input=stdin, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny Llama directory and HF's greedy continuation (12 tokens) of each prompt."""
    path = make_tiny_model(tmp_path_factory.mktemp("cli_models"), "llama")
    tok = Tokenizer.from_dir(path)
    hf = load_hf_model(path)
    return path, [hf_greedy(hf, tok.encode(p), 12)[0] for p in PROMPTS]


def test_json_output_matches_hf(tiny: tuple[Path, list[list[int]]]) -> None:
    path, refs = tiny
    proc = sglx("--model-path", str(path), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "12",
                "--ignore-eos", "--json", "--page-size", "16", "--chunked-prefill-size", "16", "--dtype", "float32",
                "--attention-backend", "torch_native")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in lines] == PROMPTS
    for record, ref in zip(lines, refs):
        assert record["output_ids"] == ref
        assert record["completion_tokens"] == 12 and record["finish_reason"] == "length"
        assert record["prompt_tokens"] > 0 and isinstance(record["text"], str)
        assert record["attention_backend"]["prefill"] == record["attention_backend"]["decode"] == "torch_native"
        assert record["attention_backend"]["page_size"] == 16


def test_text_output_streams_the_same_text(tiny: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    path, refs = tiny
    tok = Tokenizer.from_dir(path)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n", encoding="utf-8")
    proc = sglx("--model-path", str(path), "--prompts-file", str(prompts_file), "--max-new-tokens", "12",
                "--ignore-eos", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    for prompt, ref in zip(PROMPTS, refs):
        assert f">>> {prompt}\n{tok.decode(ref)}\n" in proc.stdout
    assert "attention: torch_native" in proc.stderr


def test_chat_template_prompt(tiny: tuple[Path, list[list[int]]]) -> None:
    path, _ = tiny
    result = CliRunner().invoke(app, ["generate", "--model-path", str(path), "--prompt", "hello", "--chat",
                                      "--system", "be brief", "--max-new-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[-1])
    tok = Tokenizer.from_dir(path)
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert record["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "x", "--attention-backend", "nope"], "nope"),
    (["--prompt", "x", "--chunked-prefill-size", "0"], "--chunked-prefill-size 0"),
    (["--prompt", "x", "--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    ([], "nothing to generate"),
    (["--prompt", "x", "--model-path", "/no/such/model"], "no such directory"),
])
def test_user_errors_exit_2_without_traceback(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["generate", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_unrunnable_backend_is_a_clear_error(tiny: tuple[Path, list[list[int]]]) -> None:
    path, _ = tiny
    proc = sglx("--model-path", str(path), "--prompt", "x", "--attention-backend", "fa3")
    assert proc.returncode == 2
    assert "--attention-backend fa3 cannot run here" in proc.stderr and "torch_native" in proc.stderr
    assert "Traceback" not in proc.stderr


def _embedded_ready() -> bool:
    from sglx.llm.embedded import default_model_path

    return (default_model_path() / "config.json").is_file()


@pytest.mark.skipif(not _embedded_ready(), reason="the embedded model is not built yet")
def test_embedded_model_answers_by_default() -> None:
    import random

    from sglx.llm.embedded.task import make_example, normalize_output

    rng = random.Random(5)
    examples = [make_example(rng, 40) for _ in range(2)]
    proc = sglx(*[a for prompt, _ in examples for a in ("--prompt", prompt)], "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [normalize_output(r["text"]) for r in records] == [answer for _, answer in examples]


def test_cuda_on_a_machine_without_it_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(app, ["generate", "--prompt", "x", "--device", "cuda"])
    assert result.exit_code == 2 and "CUDA is not available" in result.output and "--device cpu" in result.output


def test_text_prompts_without_a_tokenizer_fail_before_loading_weights() -> None:
    """A shipped dummy config has no tokenizer: the error comes at once, not after building 16 GB of weights."""
    import time

    start = time.perf_counter()
    result = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--model-path", "llama-3.1-8b",
                                      "--load-format", "dummy"])
    assert result.exit_code == 2
    assert "no tokenizer.json" in result.output and "--tokenizer-path" in result.output
    assert time.perf_counter() - start < 20
