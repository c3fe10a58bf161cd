"""POST /v1/completions and /v1/chat/completions: OpenAI's request and response shapes on sglx.Engine.

Streaming responses are Server-Sent Events ending with `data: [DONE]`; with
stream_options.include_usage the last event before it carries the usage and no choices.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglx.llm.sampling import SamplingParams
from sglx.server.errors import APIError
from sglx.server.generation import Choice, run_choices, until_disconnect
from sglx.server.logprobs import CompletionLogprobs, chat_logprobs, merge_completion
from sglx.server.prompts import check_ids, check_length, encode_chat, encode_text
from sglx.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from sglx.server.request_body import parse_body
from sglx.server.sse import SSEResponse
from sglx.server.state import ServerState, engine_failure

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def sampling_params(req: SamplingFields, max_new_tokens: int, choice: int) -> SamplingParams:
    """The engine's parameters for choice number `choice` (seed + choice: choice 0 matches an n=1 request)."""
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        stop=req.stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        seed=None if req.seed is None else req.seed + choice,
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _finish(result: dict[str, Any]) -> str:
    """OpenAI's finish_reason for a finished engine request; an engine-side abort is an error."""
    if result.get("finish_reason") == "abort" or result.get("error") and result.get("finish_reason") != "length":
        raise engine_failure(result.get("error") or "the request was aborted")
    return "length" if result.get("finish_reason") == "length" else "stop"


def _matched(result: dict[str, Any]) -> Any:
    return result.get("matched_stop")


async def _collect(state: ServerState, choices: list[Choice], arrival: float) -> dict[int, dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    async for choice, chunk in run_choices(state.engine, choices, state.metrics, arrival):
        if chunk["finished"]:
            results[choice.index] = chunk["result"]
    return results


def _stream_error(exc: Exception) -> str:
    err = exc if isinstance(exc, APIError) else engine_failure(f"{type(exc).__name__}: {exc}")
    return _sse(err.body())


# ---------------------------------------------------------------------------------------------- completions


async def completions(request: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = request.app.state.sglx
    req = await parse_body(request, CompletionRequest)
    state.check_model(req.model)
    engine = state.engine
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [(encode_text(engine, prompt, "prompt"), "prompt")]
    elif isinstance(prompt[0], str):
        prompts = [(encode_text(engine, p, f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)]
    elif isinstance(prompt[0], int):
        prompts = [(check_ids(engine, list(prompt), "prompt"), "prompt")]
    else:
        prompts = [(check_ids(engine, list(p), f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)]
    n = req.n or 1
    choices: list[Choice] = []
    for p, (ids, param) in enumerate(prompts):
        budget = check_length(engine, ids, req.max_tokens, param)
        max_new = req.max_tokens if req.max_tokens is not None else min(DEFAULT_COMPLETION_MAX_TOKENS, budget)
        for j in range(n):
            choices.append(Choice(p * n + j, p, ids, sampling_params(req, max_new, j),
                                  logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0))
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream_completion(state, choices, arrival, rid, created, prompt_tokens,
                                                    include_usage, req.logprobs or 0))
    results = await until_disconnect(request.receive, _collect(state, choices, arrival))
    out_choices = []
    for c in choices:
        r = results[c.index]
        logprobs = None
        if c.logprobs:
            lp = CompletionLogprobs(engine, c.top_logprobs)
            logprobs = merge_completion([lp.part(r["output_ids"], r.get("output_logprobs", []),
                                                 r.get("output_top_logprobs"))])
        out_choices.append({"index": c.index, "text": r["text"], "logprobs": logprobs, "finish_reason": _finish(r),
                            "matched_stop": _matched(r)})
    completion_tokens = sum(results[c.index]["completion_tokens"] for c in choices)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": out_choices, "usage": _usage(prompt_tokens, completion_tokens)})


def _stream_completion(state: ServerState, choices: list[Choice], arrival: float, rid: str, created: int,
                       prompt_tokens: int, include_usage: bool, top: int) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    logprob_state = {c.index: CompletionLogprobs(state.engine, top) for c in choices if c.logprobs}

    def item(choice: Choice, chunk: dict[str, Any], finish: str | None) -> dict[str, Any]:
        logprobs = None
        if choice.index in logprob_state:
            logprobs = logprob_state[choice.index].part(chunk["output_ids"], chunk.get("logprobs") or [],
                                                        chunk.get("top_logprobs"))
        return {"text": chunk["text"], "logprobs": logprobs}

    return _stream_events(state, choices, arrival, base, prompt_tokens, include_usage, item)


async def _stream_events(state: ServerState, choices: list[Choice], arrival: float, base: dict[str, Any],
                         prompt_tokens: int, include_usage: bool,
                         item_for: Callable[[Choice, dict[str, Any], str | None], dict[str, Any]],
                         first_items: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
    """The SSE loop both streaming routes share: an event per chunk, then usage, errors and [DONE]."""
    extra = {"usage": None} if include_usage else {}
    completion_tokens = 0
    try:
        for first in first_items:
            yield _sse({**base, "choices": [first], **extra})
        async for choice, chunk in run_choices(state.engine, choices, state.metrics, arrival):
            completion_tokens += len(chunk["output_ids"])
            finish = _finish(chunk["result"]) if chunk["finished"] else None
            if not chunk["output_ids"] and not chunk["text"] and finish is None:
                continue
            item: dict[str, Any] = {"index": choice.index, **item_for(choice, chunk, finish),
                                    "finish_reason": finish}
            if finish is not None:
                item["matched_stop"] = _matched(chunk["result"])
            yield _sse({**base, "choices": [item], **extra})
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    except Exception as exc:  # noqa: BLE001 - reported in the stream; the HTTP status was already sent
        state.log_stream_error(exc)
        yield _stream_error(exc)
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------- chat


async def chat_completions(request: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = request.app.state.sglx
    req = await parse_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    engine = state.engine
    ids = encode_chat(engine, [{"role": m.role, "content": m.text()} for m in req.messages])
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = check_length(engine, ids, max_tokens, "messages", limit_param)
    n = req.n or 1
    top = req.top_logprobs or 0
    choices = [Choice(j, 0, ids, sampling_params(req, budget, j), logprobs=bool(req.logprobs), top_logprobs=top)
               for j in range(n)]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream_chat(state, choices, arrival, rid, created, len(ids), include_usage))
    results = await until_disconnect(request.receive, _collect(state, choices, arrival))
    out_choices = []
    for c in choices:
        r = results[c.index]
        logprobs = None
        if c.logprobs:
            logprobs = chat_logprobs(engine, r["output_ids"], r.get("output_logprobs", []),
                                     r.get("output_top_logprobs") if top else None)
        out_choices.append({"index": c.index, "message": {"role": "assistant", "content": r["text"]},
                            "logprobs": logprobs, "finish_reason": _finish(r), "matched_stop": _matched(r)})
    completion_tokens = sum(results[c.index]["completion_tokens"] for c in choices)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                         "choices": out_choices, "usage": _usage(len(ids), completion_tokens)})


def _stream_chat(state: ServerState, choices: list[Choice], arrival: float, rid: str, created: int,
                 prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    # the first chunk of every choice names the role, as OpenAI's does
    roles = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None} for c in choices]

    def item(choice: Choice, chunk: dict[str, Any], finish: str | None) -> dict[str, Any]:
        logprobs = None
        if choice.logprobs:
            logprobs = chat_logprobs(state.engine, chunk["output_ids"], chunk.get("logprobs") or [],
                                     chunk.get("top_logprobs") if choice.top_logprobs else None)
        delta = {"content": chunk["text"]} if chunk["text"] or finish is None else {}
        return {"delta": delta, "logprobs": logprobs}

    return _stream_events(state, choices, arrival, base, prompt_tokens, include_usage, item, roles)
