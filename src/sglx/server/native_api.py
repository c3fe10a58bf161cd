"""POST /generate: SGLang's native API (text or input_ids, sampling_params, meta_info in the answer).

Like `sglx generate` and Engine.generate, max_new_tokens is clipped to what the context leaves.
Streaming sends the cumulative text and output_ids so far in each event (SGLang's default), then
`data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglx.llm.sampling import SamplingParams
from sglx.server.errors import APIError
from sglx.server.generation import Choice, run_choices, until_disconnect
from sglx.server.logprobs import token_text
from sglx.server.prompts import check_ids, check_length, encode_text
from sglx.server.protocol import GenerateRequest
from sglx.server.request_body import parse_body
from sglx.server.sse import SSEResponse
from sglx.server.state import ServerState, engine_failure


def _meta(state: ServerState, result: dict[str, Any], choice: Choice) -> dict[str, Any]:
    reason = result.get("finish_reason")
    if reason == "abort":
        raise engine_failure(result.get("error") or "the request was aborted")
    meta: dict[str, Any] = {
        "id": result.get("rid"), "prompt_tokens": result["prompt_tokens"],
        "completion_tokens": result["completion_tokens"], "cached_tokens": result.get("cached_tokens", 0),
        "finish_reason": {"type": reason, "matched": result.get("matched_stop")}, "e2e_latency":
        result.get("e2e_latency")}
    if choice.logprobs:
        ids = result["output_ids"]
        meta["output_token_logprobs"] = [[lp, t, token_text(state.engine, t)]
                                         for lp, t in zip(result.get("output_logprobs", []), ids)]
        if choice.top_logprobs:
            meta["output_top_logprobs"] = [[[lp, t, token_text(state.engine, t)] for t, lp in step]
                                           for step in result.get("output_top_logprobs", [])]
    return meta


async def generate(request: Request) -> Response:
    arrival = time.perf_counter()
    state: ServerState = request.app.state.sglx
    req = await parse_body(request, GenerateRequest)
    engine = state.engine
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        params = ["text" if not req.is_batch else f"text[{i}]" for i in range(len(texts))]
        prompts = [encode_text(engine, t, p) for t, p in zip(texts, params)]
    else:
        raw = req.input_ids if req.is_batch else [req.input_ids]
        params = ["input_ids" if not req.is_batch else f"input_ids[{i}]" for i in range(len(raw))]  # type: ignore[arg-type]
        prompts = [check_ids(engine, list(ids), p) for ids, p in zip(raw, params)]  # type: ignore[arg-type]
    for ids, param in zip(prompts, params):
        check_length(engine, ids, None, param)
    sp = req.sampling_params
    sampling = SamplingParams(**{**sp.model_dump(), "stop": sp.stop, "stop_token_ids": tuple(sp.stop_token_ids)})
    choices = [Choice(i, i, ids, sampling, logprobs=req.return_logprob or req.top_logprobs_num > 0,
                      top_logprobs=req.top_logprobs_num) for i, ids in enumerate(prompts)]
    if req.stream:
        return SSEResponse(_stream(state, choices[0], arrival))

    async def collect() -> list[dict[str, Any]]:
        results: dict[int, dict[str, Any]] = {}
        async for choice, chunk in run_choices(engine, choices, state.metrics, arrival):
            if chunk["finished"]:
                results[choice.index] = chunk["result"]
        return [{"text": results[c.index]["text"], "output_ids": results[c.index]["output_ids"],
                 "meta_info": _meta(state, results[c.index], c)} for c in choices]

    outputs = await until_disconnect(request.receive, collect())
    return JSONResponse(outputs if req.is_batch else outputs[0])


async def _stream(state: ServerState, choice: Choice, arrival: float) -> AsyncIterator[str]:
    text, ids = "", []
    try:
        async for _, chunk in run_choices(state.engine, [choice], state.metrics, arrival):
            text += chunk["text"]
            ids += chunk["output_ids"]
            if not chunk["finished"] and not chunk["output_ids"]:
                continue
            meta: dict[str, Any] = {"id": chunk["rid"], "prompt_tokens": len(choice.input_ids),
                                    "completion_tokens": len(ids), "finish_reason": None}
            if chunk["finished"]:
                meta = _meta(state, chunk["result"], choice)
                text = chunk["result"]["text"]
            yield f"data: {json.dumps({'text': text, 'output_ids': ids, 'meta_info': meta})}\n\n"
    except Exception as exc:  # noqa: BLE001 - reported in the stream; the HTTP status was already sent
        state.log_stream_error(exc)
        err = exc if isinstance(exc, APIError) else engine_failure(f"{type(exc).__name__}: {exc}")
        yield f"data: {json.dumps(err.body())}\n\n"
    yield "data: [DONE]\n\n"
