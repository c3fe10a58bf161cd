"""Load: 240 streamed requests, 32 at a time, against a real `sglx serve`: no errors, every stream ends with
[DONE] and holds exactly the tokens asked for, greedy answers equal the same request sent alone, metrics
count it all, and afterwards no request runs and the KV pool's free count is back where it started."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import httpx
import pytest

from server_test_utils import ServerProcess, engine_load, start_server, wait_idle
from server_test_utils import model_path as pick_model

NUM_REQUESTS = 240
CONCURRENCY = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = pick_model(tmp_path_factory.mktemp("load_model"))
    proc = start_server(model, tmp_path_factory.mktemp("load_logs"))
    yield proc
    proc.stop()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def make_request(i: int, vocab: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """Mixed traffic: completions by text or token ids, chat, greedy and seeded sampling, 2-24 output tokens."""
    max_tokens = rng.randint(2, 24)
    common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}}
    common["temperature"] = 0.0 if i % 3 == 0 else 0.8
    if i % 3:
        common["seed"] = i
    kind = i % 4
    if kind == 0:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"k{i % 128}=abcd; ? k"}]}
    if kind == 1:
        return "/v1/completions", {**common, "prompt": [rng.randrange(vocab) for _ in range(rng.randint(4, 120))]}
    pairs = "".join(f"k{rng.randrange(128)}={''.join(rng.choices('abcdefgh', k=4))}; "
                    for _ in range(rng.randint(1, 12)))
    return "/v1/completions", {**common, "prompt": f"{pairs}? k{rng.randrange(128)}="}


async def stream_one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    text, done, usage, errors = "", False, None, []
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            if done:
                errors.append("data after [DONE]")
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"]["message"])
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return {"text": text, "done": done, "usage": usage, "errors": errors}


def test_many_concurrent_streams(server: ServerProcess) -> None:
    base = server.base_url
    httpx.post(f"{base}/flush_cache")
    initial = engine_load(base)
    assert initial["kv_free"] == initial["kv_total"]
    vocab = httpx.get(f"{base}/server_info").json()["vocab_size"]
    metrics_before = httpx.get(f"{base}/metrics").text
    rng = random.Random(0)
    requests = [make_request(i, vocab, rng) for i in range(NUM_REQUESTS)]

    async def run_all() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(CONCURRENCY)
        peak = [0, 0]
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
            async def one(path: str, body: dict[str, Any]) -> dict[str, Any]:
                async with gate:
                    peak[0] += 1
                    peak[1] = max(peak[1], peak[0])
                    try:
                        return await stream_one(client, path, body)
                    finally:
                        peak[0] -= 1
            results = await asyncio.gather(*(one(p, b) for p, b in requests))
        assert peak[1] == CONCURRENCY
        return results

    results = asyncio.run(run_all())
    problems = [(i, r) for i, r in enumerate(results) if r.get("error") or r["errors"] or not r["done"]]
    assert not problems, problems[:3]
    for (_, body), r in zip(requests, results):
        assert r["usage"]["completion_tokens"] == body["max_tokens"]  # ignore_eos: exactly what was asked

    # Greedy answers under load equal the same request alone (batching does not change results).
    for (path, body), r in list(zip(requests, results))[:24]:
        if body["temperature"] == 0.0:
            alone = httpx.post(f"{base}{path}", json={**body, "stream": False, "stream_options": None},
                               timeout=60).json()
            choice = alone["choices"][0]
            assert (choice.get("text") if "text" in choice else choice["message"]["content"]) == r["text"]

    load = wait_idle(base)
    assert load["running_requests"] == 0 and load["queued_requests"] == 0 and load["kv_used"] == 0, load
    assert httpx.post(f"{base}/flush_cache").json()["kv_free"] == initial["kv_free"]
    assert engine_load(base)["kv_free"] == initial["kv_free"]

    after = httpx.get(f"{base}/metrics").text
    generated = sum(body["max_tokens"] for _, body in requests)
    assert metric(after, "sglx_generation_tokens_total") - metric(metrics_before, "sglx_generation_tokens_total") \
        >= generated
    assert metric(after, "sglx_time_to_first_token_seconds_count") - \
        metric(metrics_before, "sglx_time_to_first_token_seconds_count") >= NUM_REQUESTS
    assert metric(after, "sglx_num_running_requests") == 0
    assert metric(after, "sglx_kv_cache_used_tokens") == 0
    assert metric(after, "sglx_kv_cache_total_tokens") == initial["kv_total"]
    ok = re.findall(r'sglx_http_requests_total\{method="POST",route="/v1/(?:chat/)?completions",status="200"\} (\d+)',
                    after)
    assert sum(map(int, ok)) >= NUM_REQUESTS


def test_server_survives_and_serves_after_load(server: ServerProcess) -> None:
    out = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "k1=abcd; ? k1=", "max_tokens": 3,
                                                                "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.base_url}/health").status_code == 200
