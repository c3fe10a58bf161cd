"""Turn request prompts into token ids and check them against the engine before anything is queued.

Checking here (not in the scheduler) lets a too-long prompt or an out-of-vocabulary id be a 400
naming the parameter, instead of a failed generation.
"""

from __future__ import annotations

from typing import Any

from sglx.errors import SglxError
from sglx.server.errors import APIError, bad_request
from sglx.server.served_engine import ServedEngine


def _tokenizer(engine: ServedEngine, param: str) -> Any:
    if engine.tokenizer is None:
        raise bad_request(f"this model ({engine.model_path}) has no tokenizer, so text prompts cannot be "
                          "encoded; send token ids (a list of integers) as the prompt instead", param)
    return engine.tokenizer


def encode_text(engine: ServedEngine, text: str, param: str) -> list[int]:
    return list(_tokenizer(engine, param).encode(text))


def encode_chat(engine: ServedEngine, messages: list[dict[str, str]]) -> list[int]:
    tok = _tokenizer(engine, "messages")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    except SglxError as exc:
        raise bad_request(str(exc), "messages") from exc
    return list(tok.encode(text, add_special_tokens=False))


def check_ids(engine: ServedEngine, ids: list[int], param: str) -> list[int]:
    vocab = engine.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{param}: token ids must be in [0, {vocab}) for this model; got {bad[:5]}", param)
    return ids


def check_length(engine: ServedEngine, ids: list[int], max_tokens: int | None, param: str,
                 max_tokens_param: str = "max_tokens") -> int:
    """Validate prompt length (+ requested output) against the context; returns the output budget."""
    context = engine.context_length
    capacity = engine.capacity
    if not ids:
        raise bad_request(f"{param}: the prompt is empty (0 tokens)", param)
    if len(ids) >= capacity:
        raise APIError(400, f"{param}: the prompt has {len(ids)} tokens, but this model takes at most "
                            f"{capacity - 1} prompt tokens (context length {context})", param,
                       "context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > context:
        raise APIError(400, f"{max_tokens_param}: {len(ids)} prompt tokens + {max_tokens} output tokens exceed the "
                            f"context length of {context}; ask for at most {context - len(ids)}",
                       max_tokens_param, "context_length_exceeded")
    return max_tokens if max_tokens is not None else context - len(ids)
