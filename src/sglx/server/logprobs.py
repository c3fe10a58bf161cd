"""Log-probabilities in the OpenAI response shapes (legacy completions and chat).

Values are log-softmax of the model's raw logits at each step (before temperature and penalties),
as vLLM reports by default; a token's text is its own decoding, special tokens included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sglx.server.served_engine import ServedEngine


def token_text(engine: ServedEngine, token_id: int) -> str:
    if engine.tokenizer is None:
        return f"token_id:{token_id}"
    return engine.tokenizer.decode([int(token_id)], skip_special_tokens=False)


class CompletionLogprobs:
    """Accumulates {"tokens", "token_logprobs", "top_logprobs", "text_offset"} across chunks."""

    def __init__(self, engine: ServedEngine, top: int) -> None:
        self.engine = engine
        self.top = top
        self.offset = 0

    def part(self, ids: Sequence[int], logprobs: Sequence[float],
             tops: Sequence[Sequence[tuple[int, float]]] | None) -> dict[str, Any]:
        tokens = [token_text(self.engine, t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        top_logprobs = None
        if self.top and tops is not None:
            top_logprobs = []
            for step in tops:  # best first; tokens that decode alike (partial UTF-8) keep the best value
                entry: dict[str, float] = {}
                for t, lp in step:
                    entry.setdefault(token_text(self.engine, t), lp)
                top_logprobs.append(entry)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_logprobs,
                "text_offset": offsets}


def chat_logprobs(engine: ServedEngine, ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]] | None) -> dict[str, Any]:
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = token_text(engine, token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token_id, lp) in enumerate(zip(ids, logprobs)):
        item = entry(token_id, lp)
        item["top_logprobs"] = [entry(t, v) for t, v in tops[i]] if tops is not None else []
        content.append(item)
    return {"content": content}


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": []}
    for p in parts:
        out["tokens"] += p["tokens"]
        out["token_logprobs"] += p["token_logprobs"]
        out["text_offset"] += p["text_offset"]
        if p["top_logprobs"] is not None:
            out["top_logprobs"] = (out["top_logprobs"] or []) + p["top_logprobs"]
    return out
