"""`sglx serve` through the official openai client and raw HTTP: results equal `sglx generate`, streaming,
stop, n, seed, usage, logprobs (against Hugging Face transformers), /generate, disconnects, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from llm_test_utils import load_hf_model
from server_test_utils import ENGINE_ARGS, ServerProcess, engine_load, engine_processes, start_server, wait_idle
from server_test_utils import model_path as pick_model
from sglx.llm.tokenizer import Tokenizer

PROMPT = "k3=abcd; k7=efgh; k12=wxyz; ? k7="
CHAT_TEXT = "k5=mnop; k9=qrst; ? k9="
FREE_PROMPT = "hello world zz"  # unlike the embedded model's training data: its samples spread out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pick_model(tmp_path_factory.mktemp("server_model"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    proc = start_server(model, tmp_path_factory.mktemp("server_logs"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def sglx_generate(model: Path, *args: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sglx", "generate", "--model-path", str(model), *ENGINE_ARGS,
                           "--json", *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def sse_events(base_url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """Every `data:` event of a streamed response, "[DONE]" included, as parsed JSON (or the raw string)."""
    events: list[Any] = []
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------------------------------ info


def test_models_and_server_info(server: ServerProcess, client: openai.OpenAI, model: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model.name]
    info = httpx.get(f"{server.base_url}/server_info").json()
    assert info["served_model_name"] == model.name
    assert info["attention"]["prefill"] == info["attention"]["decode"] == "torch_native"
    assert info["attention"]["why"]  # the reason the backend was selected
    assert info["kv_pool"]["total"] == 16384
    assert info["kv_pool"]["available"] + info["kv_pool"]["used"] == info["kv_pool"]["total"]
    assert info["engine_config"]["max_total_tokens"] == 16384
    assert "attention backend: torch_native" in server.log()  # the startup banner names the backend and why
    assert info["attention"]["why"] in server.log()
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------------------------ equal to sglx generate


def test_greedy_completion_equals_sglx_generate(client: openai.OpenAI, model: Path, model_name: str,
                                                server: ServerProcess) -> None:
    ref = sglx_generate(model, "--prompt", PROMPT, "--max-new-tokens", "12", "--ignore-eos")
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == ref["prompt_tokens"]
    assert out.usage.completion_tokens == 12 == ref["completion_tokens"]
    native = httpx.post(f"{server.base_url}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}).json()
    assert native["output_ids"] == ref["output_ids"]
    assert native["text"] == ref["text"]
    assert native["meta_info"]["finish_reason"]["type"] == "length"


def test_every_sampling_parameter_reaches_the_engine(client: openai.OpenAI, model: Path, model_name: str,
                                                      server: ServerProcess) -> None:
    """A seeded sample with every knob set equals `sglx generate` with the same flags (and differs without them)."""
    knobs = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "repetition_penalty": 1.3,
             "frequency_penalty": 0.5, "presence_penalty": 0.4, "seed": 11}
    flags = [x for k, v in knobs.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    ref = sglx_generate(model, "--prompt", FREE_PROMPT, "--max-new-tokens", "16", "--ignore-eos", *flags)
    out = client.completions.create(model=model_name, prompt=FREE_PROMPT, max_tokens=16,
                                    temperature=knobs["temperature"], top_p=knobs["top_p"], seed=knobs["seed"],
                                    frequency_penalty=knobs["frequency_penalty"],
                                    presence_penalty=knobs["presence_penalty"],
                                    extra_body={"ignore_eos": True, "top_k": knobs["top_k"], "min_p": knobs["min_p"],
                                                "repetition_penalty": knobs["repetition_penalty"]})
    assert out.choices[0].text == ref["text"]
    native = httpx.post(f"{server.base_url}/generate", json={
        "text": FREE_PROMPT, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **knobs}}).json()
    assert native["output_ids"] == ref["output_ids"]
    plain = httpx.post(f"{server.base_url}/generate", json={
        "text": FREE_PROMPT, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.8,
                                                 "seed": 11}}).json()
    assert plain["output_ids"] != ref["output_ids"]  # the knobs changed the sample


def test_batched_prompts_and_n(client: openai.OpenAI, model_name: str) -> None:
    single = [client.completions.create(model=model_name, prompt=p, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}) for p in (PROMPT, CHAT_TEXT)]
    both = client.completions.create(model=model_name, prompt=[PROMPT, CHAT_TEXT], max_tokens=6, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [single[0].choices[0].text] * 2 + [single[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == single[0].usage.prompt_tokens + single[1].usage.prompt_tokens
    assert both.usage.completion_tokens == 24
    default = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_greedy_chat_equals_sglx_generate_chat(client: openai.OpenAI, model: Path, model_name: str) -> None:
    ref = sglx_generate(model, "--prompt", CHAT_TEXT, "--chat", "--max-new-tokens", "10", "--ignore-eos")
    out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_TEXT}],
                                         max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == ref["prompt_tokens"]
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == ref["prompt_tokens"] + 10


# ------------------------------------------------------------------------------------------ streaming


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI, server: ServerProcess,
                                                 model_name: str) -> None:
    kwargs: dict[str, Any] = dict(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    events = sse_events(server.base_url, "/v1/completions", {**kwargs.pop("extra_body"), **kwargs, "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full.choices[0].text


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = dict(model=model_name, messages=[{"role": "user", "content": CHAT_TEXT}],
                                  max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------ stop, n, seed


def test_stop_strings_cut_the_output(client: openai.OpenAI, model_name: str) -> None:
    kwargs: dict[str, Any] = dict(model=model_name, prompt=FREE_PROMPT, max_tokens=24, temperature=2.0,
                                  extra_body={"ignore_eos": True})
    for seed in range(8):  # a seeded sample: the same tokens again, so the cut point is known in advance
        base = client.completions.create(**kwargs, seed=seed).choices[0].text
        if len(base) >= 6:
            break
    assert len(base) >= 6, f"need a longer text to cut: {base!r}"
    stop = base[3:5]
    expected = base[:base.find(stop)]
    for stops in (stop, [stop, "\u2603never"]):
        for stream in (False, True):
            out = client.completions.create(**kwargs, seed=seed, stop=stops, stream=stream)
            if stream:
                pieces = list(out)
                text = "".join(c.choices[0].text for c in pieces)
                reason = pieces[-1].choices[0].finish_reason
            else:
                text, reason = out.choices[0].text, out.choices[0].finish_reason
            assert text == expected, (stops, stream)
            assert reason == "stop"


def test_seeds_change_samples(server: ServerProcess) -> None:
    """Token ids (special tokens included) of hot samples from an out-of-distribution prompt: seeds must matter."""
    def ids(seed: int) -> list[int]:
        return httpx.post(f"{server.base_url}/generate", json={"text": FREE_PROMPT, "sampling_params": {
            "max_new_tokens": 16, "temperature": 2.0, "ignore_eos": True, "seed": seed}}).json()["output_ids"]

    samples = [ids(seed) for seed in range(4)]
    assert ids(0) == samples[0]
    assert len({tuple(s) for s in samples}) > 1


def test_n_choices_and_seed_reproducibility(client: openai.OpenAI, model_name: str) -> None:
    def sample(n: int, seed: int, stream: bool = False) -> list[str]:
        out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, n=n,
                                        seed=seed, stream=stream, extra_body={"ignore_eos": True})
        if not stream:
            assert [c.index for c in out.choices] == list(range(n))
            return [c.text for c in out.choices]
        texts = [""] * n
        for chunk in out:
            for c in chunk.choices:
                texts[c.index] += c.text
        return texts

    three = sample(3, 1234)
    assert sample(3, 1234) == three  # same seed, same texts
    assert sample(3, 1234, stream=True) == three
    assert sample(1, 1234) == three[:1]  # choice i uses seed + i
    chat_kwargs: dict[str, Any] = dict(model=model_name, messages=[{"role": "user", "content": CHAT_TEXT}],
                                       max_tokens=8, n=2, seed=7, temperature=1.0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**chat_kwargs)
    again = client.chat.completions.create(**chat_kwargs)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]
    assert chat.usage.completion_tokens == 16  # both choices count; the prompt counts once
    one = client.chat.completions.create(**{**chat_kwargs, "n": 1})
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens
    assert one.choices[0].message.content == chat.choices[0].message.content


# ------------------------------------------------------------------------------------------ logprobs


def test_logprobs_match_transformers(client: openai.OpenAI, server: ServerProcess, model: Path,
                                     model_name: str) -> None:
    native = httpx.post(f"{server.base_url}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 3}).json()
    ids = native["output_ids"]
    tok = Tokenizer.from_dir(model)
    prompt_ids = tok.encode(PROMPT)
    hf = load_hf_model(model)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + ids])).logits[0].double()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]  # position t predicts token t + 1
    expected = [float(ref[i, t]) for i, t in enumerate(ids)]
    got = [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(expected, abs=2e-3)
    for step, row in zip(native["meta_info"]["output_top_logprobs"], ref):
        values, top_ids = row.topk(3)
        assert [t for _, t, _ in step] == top_ids.tolist()
        assert [lp for lp, _, _ in step] == pytest.approx(values.tolist(), abs=2e-3)

    comp = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected, abs=2e-3)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert all(len(d) <= 3 and max(d.values()) == pytest.approx(v, abs=1e-6)  # greedy picks the top token
               for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_TEXT}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)
    streamed = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": CHAT_TEXT}], max_tokens=4, temperature=0,
        logprobs=True, stream=True))
    lps = [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
           for c in ch.choices[0].logprobs.content]
    assert lps == pytest.approx([c.logprob for c in content], abs=1e-6)


# ------------------------------------------------------------------------------------------ native API


def test_native_generate_batch_and_stream(server: ServerProcess) -> None:
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    single = httpx.post(f"{server.base_url}/generate", json={"text": PROMPT, "sampling_params": params}).json()
    batch = httpx.post(f"{server.base_url}/generate",
                       json={"text": [PROMPT, CHAT_TEXT], "sampling_params": params}).json()
    assert len(batch) == 2 and batch[0]["output_ids"] == single["output_ids"]
    by_ids = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": [1, 5, 9, 14, 20], "sampling_params": params}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == 5 and len(by_ids["output_ids"]) == 6
    events = sse_events(server.base_url, "/generate", {"text": PROMPT, "sampling_params": params, "stream": True})
    assert events[-1] == "[DONE]"
    assert events[-2]["output_ids"] == single["output_ids"] and events[-2]["text"] == single["text"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------------------------------ disconnects


def test_disconnects_abort_requests_and_free_kv(server: ServerProcess) -> None:
    httpx.post(f"{server.base_url}/flush_cache")
    before = engine_load(server.base_url)
    aborts_before = abort_count(server.base_url)
    context = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def drop_streams() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            async def one(i: int) -> None:
                async with c.stream("POST", "/v1/completions", json={**body, "prompt": f"{PROMPT} {i}",
                                                                      "stream": True}) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return  # leaving the block closes the connection mid-stream
            await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(drop_streams())
    # Non-streaming: 16 long generations each, and the client gives up long before they could finish.
    prompt = [5] * 10
    for path, payload in (
            ("/v1/completions", {"prompt": prompt, "max_tokens": context - 10, "n": 16, "ignore_eos": True}),
            ("/generate", {"input_ids": [prompt] * 16, "sampling_params": {"max_new_tokens": context,
                                                                           "ignore_eos": True}})):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base_url}{path}", json=payload, timeout=0.3)
    load = wait_idle(server.base_url, timeout=20)
    assert load["running_requests"] == 0 and load["queued_requests"] == 0 and load["kv_used"] == 0, load
    assert abort_count(server.base_url) - aborts_before == 6 + 16 + 16  # every dropped generation was aborted
    httpx.post(f"{server.base_url}/flush_cache")
    assert engine_load(server.base_url)["kv_free"] == before["kv_free"]


def abort_count(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics").text
    found = re.search(r'^sglx_generation_requests_total\{finish_reason="abort"\} (\d+)$', text, re.MULTILINE)
    return int(found.group(1)) if found else 0


# ------------------------------------------------------------------------------------------ lifecycle


def test_sigterm_finishes_in_flight_stream_and_exits_zero(model: Path, tmp_path: Path) -> None:
    proc = start_server(model, tmp_path, "--grace-period", "30")
    (engine,) = engine_processes(proc.proc.pid)  # the scheduler runs in a process of its own
    events: list[str] = []

    def read_stream() -> None:
        with httpx.stream("POST", f"{proc.base_url}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream

    read_stream()
    assert proc.stop(timeout=60) == 0, proc.log()
    assert events[-1] == "[DONE]"
    streamed = [json.loads(e) for e in events[:-1]]
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"  # finished within the grace period
    assert "server stopped" in proc.log()
    assert not engine.is_running(), "the engine process outlived the server"
    assert "leaked semaphore" not in proc.log()


def test_sigterm_aborts_what_outlives_the_grace_period_and_exits_zero(model: Path, tmp_path: Path) -> None:
    proc = start_server(model, tmp_path, "--grace-period", "1", "--max-running-requests", "1")
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def streams() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as c:
            async def one() -> list[str]:
                events: list[str] = []
                try:
                    async with c.stream("POST", "/v1/completions", json=body) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                except httpx.HTTPError:
                    pass  # the server closed the connection mid-stream
                return events

            async def stop_soon() -> None:
                await asyncio.sleep(1.0)
                proc.send_signal(signal.SIGTERM)

            results = await asyncio.gather(*(one() for _ in range(6)), stop_soon())
            return results[:6]  # type: ignore[return-value]

    started = time.monotonic()
    results = asyncio.run(streams())
    assert proc.stop(timeout=60) == 0, proc.log()
    assert time.monotonic() - started < 30  # 6 x 500 tokens one at a time would take longer than the grace
    cut = [r for r in results if not r or r[-1] != "[DONE]"]
    assert cut, "some streams must have been aborted at the end of the grace period"
    for events in cut:  # each got an error event saying why, and a clean end of stream
        assert "server shut down" in json.loads(events[-1])["error"]["message"], events[-3:]
    log = proc.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log and "server stopped" in log
    assert "shutdown grace period ran out" in log
