"""--stream-interval N (SGLang's flag): a streamed request gets its first token at once, then a chunk every N
tokens and the rest at the end; the streamed tokens and text equal the non-streamed result, in the engine and
through `sglx serve` (official openai client)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from server_test_utils import ServerProcess, start_server
from server_test_utils import model_path as pick_model
from sglx.cli.app import app
from sglx.errors import SglxError
from sglx.llm.engine import Engine
from sglx.llm.engine_config import EngineConfig

PROMPT = "k3=abcde; k7=fghij; k12=klmno; ? k7="
PARAMS = {"max_new_tokens": 11, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pick_model(tmp_path_factory.mktemp("interval_model"))


@pytest.mark.parametrize("interval", [1, 3, 20])
def test_engine_chunks_every_interval_tokens(model: Path, interval: int) -> None:
    with Engine(model_path=str(model), max_total_tokens=2048, max_running_requests=4, dtype="float32",
                stream_interval=interval) as eng:
        want = eng.generate(PROMPT, PARAMS)
        chunks = [c for c in eng.stream(PROMPT, PARAMS) if c["output_ids"] or c["finished"]]
    sizes = [len(c["output_ids"]) for c in chunks]
    expected = [1] + [interval] * ((11 - 1) // interval)
    if sum(expected) < 11:
        expected.append(11 - sum(expected))
    assert sizes == expected
    assert [t for c in chunks for t in c["output_ids"]] == want["output_ids"]
    assert "".join(c["text"] for c in chunks) == want["text"]


def test_bad_interval_is_a_usage_error() -> None:
    with pytest.raises(SglxError, match="--stream-interval 0"):
        EngineConfig(stream_interval=0)
    result = CliRunner().invoke(app, ["generate", "--prompt", "x", "--stream-interval", "0"])
    assert result.exit_code == 2 and "--stream-interval 0" in result.output


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = start_server(model, tmp_path_factory.mktemp("interval_logs"), "--stream-interval", "4")
    yield proc
    proc.stop()


def test_server_streams_every_four_tokens(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    name = client.models.list().data[0].id
    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=11, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    stream = client.completions.create(model=name, prompt=PROMPT, max_tokens=11, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, usage = [], None
    for event in stream:
        if event.choices:
            texts.append(event.choices[0].text)
        usage = event.usage or usage
    assert "".join(texts) == full.choices[0].text
    assert usage is not None and usage.completion_tokens == 11
    assert len(texts) == 4  # tokens 1 | 2-5 | 6-9 | 10-11 (the first token at once, then every 4)
