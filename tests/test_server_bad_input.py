"""Bad input against a real `sglx serve` (with an API key and a small body limit): every malformed request is a
4xx with an OpenAI-style error naming the problem, never a 5xx, and the server keeps answering."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_test_utils import ServerProcess, start_server
from server_test_utils import model_path as pick_model

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 65536
CONTEXT_TOKENS = 100_000  # longer than any test model's context


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = pick_model(tmp_path_factory.mktemp("bad_input_model"))
    proc = start_server(model, tmp_path_factory.mktemp("bad_input_logs"), "--api-key", KEY,
                        "--max-request-bytes", str(LIMIT), "--served-model-name", "served-tiny")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def assert_error(resp: httpx.Response, status: int, param: str | None = None, words: str = "") -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split(".")[0].split("[")[0] in err["message"], err
    assert words.lower() in err["message"].lower(), err
    return err


def ok_completion(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"model": "served-tiny", "prompt": "k1=abcd; ? k1=", "max_tokens": 2,
                                              "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


COMPLETION = {"prompt": "k1=abcd; ? k1=", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"text": "k1=abcd; ? k1=", "sampling_params": {"max_new_tokens": 2}}

# (path, body, expected status, expected param, words the message must contain)
CASES: list[tuple[str, dict[str, Any], int, str | None, str]] = [
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature", ""),
    ("/v1/completions", {**COMPLETION, "temperature": 2.5}, 400, "temperature", ""),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p", ""),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p", ""),
    ("/v1/completions", {**COMPLETION, "top_k": -2}, 400, "top_k", ""),
    ("/v1/completions", {**COMPLETION, "min_p": 2}, 400, "min_p", ""),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 3}, 400, "presence_penalty", ""),
    ("/v1/completions", {**COMPLETION, "frequency_penalty": -3}, 400, "frequency_penalty", ""),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty", ""),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", ""),
    ("/v1/completions", {**COMPLETION, "max_tokens": "10"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 1.5}, 400, "max_tokens", ""),
    ("/v1/completions", {**COMPLETION, "max_tokens": CONTEXT_TOKENS}, 400, "max_tokens", "context length"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n", ""),
    ("/v1/completions", {**COMPLETION, "n": 1000}, 400, "n", ""),
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"bogus": 1}}, 400,
     "stream_options.bogus", "unsupported"),
    ("/v1/completions", {**COMPLETION, "stop": 5}, 400, "stop", ""),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop", "empty"),
    ("/v1/completions", {**COMPLETION, "stop": ["a"] * 40}, 400, "stop", ""),
    ("/v1/completions", {**COMPLETION, "seed": "abc"}, 400, "seed", ""),
    ("/v1/completions", {**COMPLETION, "seed": 2**70}, 400, "seed", ""),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs", ""),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, 400, "logprobs", ""),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 5}}, 400, "logit_bias", "unsupported"),
    ("/v1/completions", {**COMPLETION, "user": "someone"}, 400, "user", "unsupported"),
    ("/v1/completions", {**COMPLETION, "echo": True}, 400, "echo", "unsupported"),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, 400, "best_of", "unsupported"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt", "required"),
    ("/v1/completions", {**COMPLETION, "prompt": None}, 400, "prompt", ""),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt", ""),
    ("/v1/completions", {**COMPLETION, "prompt": [[]]}, 400, "prompt", ""),
    ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, 400, "prompt", ""),
    ("/v1/completions", {**COMPLETION, "prompt": [-1, 2]}, 400, "prompt", "token ids"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, 400, "prompt", "token ids"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [10**9]]}, 400, "prompt[1]", "token ids"),
    ("/v1/completions", {**COMPLETION, "prompt": "k1=ab; " * 3000}, 400, "prompt", "context length"),
    ("/v1/completions", {**COMPLETION, "prompt": [5] * 2000}, 400, "prompt", "context length"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {**COMPLETION, "model": 7}, 400, "model", ""),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages", "required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", ""),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                  "image_url": "x"}]}]},
     400, "messages[0].content", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "messages[0].name", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", ""),
    ("/v1/chat/completions", {**CHAT, "tools": []}, 400, "tools", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": CONTEXT_TOKENS}, 400, "max_completion_tokens",
     "context length"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "k1=ab; " * 3000}]}, 400, "messages",
     "context length"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, None, "text or input_ids"),
    ("/generate", {**GENERATE, "input_ids": [1, 2]}, 400, None, "text or input_ids"),
    ("/generate", {**GENERATE, "sampling_params": {"max_new_tokens": -1}}, 400, "sampling_params.max_new_tokens", ""),
    ("/generate", {**GENERATE, "sampling_params": {"temprature": 0.5}}, 400, "sampling_params.temprature",
     "unsupported"),
    ("/generate", {**GENERATE, "text": ["a", "b"], "stream": True}, 400, "stream", "batch"),
    ("/generate", {"input_ids": [[1, 2], []]}, 400, None, "empty"),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids", "token ids"),
    ("/generate", {**GENERATE, "top_logprobs_num": -1}, 400, "top_logprobs_num", ""),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[3]}" for i, c in enumerate(CASES)])
def test_malformed_request_is_a_named_4xx(http: httpx.Client, path: str, body: dict[str, Any], status: int,
                                          param: str | None, words: str) -> None:
    assert_error(http.post(path, json=body), status, param, words)


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"[1, 2]", b"\"text\"", b"null", b"{\"prompt\": NaN}",
                                 b"{\"prompt\": \"a\", \"max_tokens\": Infinity}", b"\xff\xfe\x00garbage",
                                 b"[" * 5000 + b"]" * 5000])
def test_malformed_json_is_a_400(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        err = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert "json" in err["message"].lower()


def test_routes_and_methods(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nope"), 404, words="no route")
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/v1/models", json={}), 405)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "n", "seed",
          "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "max_completion_tokens", "text", "input_ids", "sampling_params",
          "return_logprob", "stop_token_ids"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
       fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6))
def test_random_requests_never_get_a_5xx(http: httpx.Client, path: str, fields: dict[str, Any]) -> None:
    body = {**fields}
    # Keep accidental valid requests short: a valid max_tokens-like field stays small.
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4
    if isinstance(body.get("sampling_params"), dict):
        body["sampling_params"]["max_new_tokens"] = 2
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    resp = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code != 200:
        assert_error(resp, resp.status_code)


def test_server_still_answers_after_bad_input(http: httpx.Client) -> None:
    ok_completion(http)


# ------------------------------------------------------------------------------------------ API key, body limit


def test_api_key_is_required_everywhere_but_health(server: ServerProcess) -> None:
    base = server.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/server_info"), ("GET", "/metrics"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
                         ("POST", "/flush_cache"), ("GET", "/v1/nope")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer  {KEY}"}):
            resp = httpx.request(method, f"{base}{path}", headers=headers, json=COMPLETION)
            err = assert_error(resp, 401)
            assert err["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"][0]["id"] == "served-tiny"


def test_oversize_body_is_a_413(http: httpx.Client, server: ServerProcess) -> None:
    big = {**COMPLETION, "prompt": "x" * (LIMIT + 10)}
    err = assert_error(http.post("/v1/completions", json=big), 413, words="limit")
    assert err["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: the limit applies while the body streams in
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1000 + 2):
            yield b"y" * 1000
        yield b'"}'

    resp = httpx.post(f"{server.base_url}/v1/completions", content=chunks(), headers=AUTH)
    assert_error(resp, 413)
    ok_completion(http)  # and the server keeps serving
    assert httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json={
        **COMPLETION, "prompt": "k1=abcd; " * 30}).status_code == 200  # under the limit: fine
