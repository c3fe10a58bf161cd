"""Data-parallel serving (`sglx serve --dp-size N`): the routing policy on its own, then a real router with two
replica processes checked with the `openai` client against one in-process engine's greedy output."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from server_test_utils import ServerProcess, model_path
from sglx.cli.app import app
from sglx.errors import SglxError
from sglx.server.dp_policy import CHUNK, CacheAwarePolicy
from sglx.server.dp_router import prompt_text

A = "The quick brown fox jumps over the lazy dog. A paged key value cache stores every token of a request."
B = "Radix trees share the prefix of prompts: the system prompt is computed once and reused many times."


def test_policy_prefix_affinity_spreads_new_prefixes_and_yields_to_load() -> None:
    policy = CacheAwarePolicy(2, balance_abs=2, balance_rel=1.5)
    first = policy.choose(A)
    second = policy.choose(B)  # nothing matches: the idle replica with the most cache to spare
    assert {first, second} == {0, 1}
    policy.done(first)
    policy.done(second)
    # prompts extending A (A covers >= half of them) return to A's replica even while it is the busier one
    assert policy.choose(A + " Continue the story.") == first
    assert policy.choose(A + " And then?") == first
    assert policy.stats()[first]["prefix_hits"] == 2
    assert policy.choose("hi") == second  # shorter than one chunk: no prefix to match, least loaded
    policy.done(second)
    # 3 in flight against 0: more than balance_abs apart and balance_rel times: load wins over affinity
    assert policy.choose(A) == first
    assert [r.in_flight for r in policy.replicas][first] == 3
    assert policy.choose(A + " Once more.") == second
    assert len("hi") < CHUNK


def test_prompt_text_of_each_route() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) == "user:hi"
    assert prompt_text({"text": "xyz"}) == "xyz"
    assert prompt_text({"input_ids": [5, 6]}) == "5 6"
    assert prompt_text({}) == ""


def test_dp_outside_serve_is_one_line(tmp_path: Path) -> None:
    from sglx.llm.engine import Engine

    with pytest.raises(SglxError, match="--dp-size 2 runs replicas behind `sglx serve`"):
        Engine(dp_size=2)
    result = CliRunner().invoke(app, ["generate", "--prompt", "x", "--dp", "2"])
    assert result.exit_code == 2 and "drop --dp-size" in result.output and "Traceback" not in result.output


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_dp2_server_matches_one_engine_and_routes_by_prefix(tmp_path: Path) -> None:
    from openai import OpenAI

    from sglx.llm.engine import Engine

    model = model_path(tmp_path)
    prompts = [A, A + " Then", B, B + " Then"]
    with Engine(model_path=str(model), dtype="float32", max_total_tokens=4096) as eng:
        expected = [r["text"] for r in eng.generate(prompts, {"max_new_tokens": 6, "temperature": 0.0,
                                                              "ignore_eos": True})]
    server = ServerProcess(model, "--dp", "2", log_dir=tmp_path,
                           engine_args=("--max-total-tokens", "4096", "--dtype", "float32"))
    try:
        server.wait_ready(timeout=240)
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = client.models.list().data[0].id  # /v1/models answered through the router
        for prompt, text in zip(prompts, expected):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt=prompts[3], max_tokens=6, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert streamed == expected[3]
        info = httpx.get(f"{server.base_url}/server_info").json()
        assert info["dp_size"] == 2
        stats = info["router"]["replicas"]
        assert [s["routed"] for s in stats] == [2, 3] or [s["routed"] for s in stats] == [3, 2]
        assert sum(s["prefix_hits"] for s in stats) == 3  # A+, B+ and the streamed B+ went where A / B went
        ports = [s["port"] for s in stats]
        assert all(_port_open(p) for p in ports)
        assert "sglx_router_routed" in httpx.get(f"{server.base_url}/metrics").text
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert not any(_port_open(p) for p in ports)
