"""One generation request as the scheduler tracks it: tokens, KV bookkeeping, stop logic and text.

KV bookkeeping: the request's row of `req_to_token` maps positions to slots; the first `kv_len`
positions hold computed K/V, of which the first `cache_len` belong to the prefix cache (kept alive by
locking `last_node`) and the rest to the request itself. Tokens `fill_ids[kv_len:]` still have to be
run through the model; when none is left after a step, the step's logits give the next token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sglx.llm.sampling import SamplingParams


class TextDecoder(Protocol):
    def push(self, token_id: int) -> str: ...


@dataclass
class OutputChunk:
    """What a request reports after a step: new text and tokens since the last chunk, and whether it ended."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    result: dict[str, Any] | None = None  # the full final output, on the finishing chunk only
    logprobs: list[float] | None = None  # of token_ids, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) best first


class Request:
    def __init__(self, rid: str, input_ids: Sequence[int], params: SamplingParams,
                 decoder: TextDecoder | None = None, generator: torch.Generator | None = None,
                 eos_token_ids: Sequence[int] = (), on_output: Callable[[OutputChunk], Any] | None = None,
                 stream: bool = False, return_logprob: bool = False, top_logprobs_num: int = 0) -> None:
        self.rid = rid
        self.input_ids = list(input_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.max_new_tokens = params.max_new_tokens  # the scheduler clips it to the context length
        self.decoder = decoder
        self.generator = generator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_output = on_output
        self.stream = stream
        self.return_logprob = return_logprob  # log-softmax of the raw logits at each chosen token
        self.output_logprobs: list[float] = []
        self.top_logprobs_num = top_logprobs_num  # also report this many most likely tokens per step
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # KV bookkeeping
        self.row = 0
        self.kv_len = 0
        self.cache_len = 0
        self.last_node: Any = None
        self.extend_len = 0  # tokens scheduled in the current step
        self.step_locs: torch.Tensor | None = None  # their KV slots (CPU)
        self.last_loc = -1  # KV slot of position kv_len - 1 when known on the host (-1: read req_to_token)
        # overlap scheduling (sglx.llm.overlap): sampled tokens still on the device, and the future-map
        # entry of the newest one (its placeholder input id is -future)
        self.pending_tokens = 0
        self.future = 0
        # host copy of this request's req_to_token row, valid for positions [0, _slots_known): the prefix
        # cache reads it instead of the device table (a device read would wait for the step in flight)
        self._slots: torch.Tensor | None = None
        self._slots_known = 0
        # results
        self.text = ""
        self._sent_text = 0
        self._sent_ids = 0
        self._checked_text = 0
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.error: str | None = None
        self.cached_tokens: int | None = None
        self.num_retractions = 0
        self.created = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ------------------------------------------------------------------ tokens

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building the whole list (decode steps read one token)."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[:end - n]

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence, counting sampled tokens the host has not read yet (overlap scheduling)."""
        return len(self.input_ids) + len(self.output_ids) + self.pending_tokens

    @property
    def remaining(self) -> int:
        """Tokens not yet run through the model."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, matched: int | str | None = None, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.matched_stop, self.error = reason, matched, error
            self.finished_time = time.perf_counter()

    def append_token(self, token: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token)
        p = self.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            self.finish("stop", token)
        else:
            if self.decoder is not None:
                self.text += self.decoder.push(token)
                self._check_stop_strings()
            if not self.finished and len(self.output_ids) >= self.max_new_tokens:
                self.finish("length")
        if self.finished and not isinstance(self.matched_stop, str):
            self._flush_text()

    def _flush_text(self) -> None:
        """Text the decoder held back (an incomplete character) once no more tokens will come."""
        flush = getattr(self.decoder, "flush", None)
        if flush is not None:
            self.text += flush()
            self._check_stop_strings()  # trims a stop string completed by the flushed text

    def _check_stop_strings(self) -> None:
        stops = self.params.stop
        if not stops:
            return
        start = max(0, self._checked_text - max(map(len, stops)) + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        self._checked_text = len(self.text)
        if best is not None:
            self.text = self.text[: best[0]]
            self.finish("stop", best[1])

    def _held_back(self) -> int:
        """Characters at the end of the text that may be the start of a stop string (not streamed yet)."""
        if self.finished or not self.params.stop:
            return 0
        longest = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    @property
    def has_new_output(self) -> bool:
        return len(self.output_ids) > self._sent_ids

    @property
    def unsent_tokens(self) -> int:
        return len(self.output_ids) - self._sent_ids

    def take_chunk(self) -> OutputChunk:
        """New text/tokens since the previous chunk (text that could still become a stop string is held back)."""
        end = len(self.text) - self._held_back()
        text = self.text[self._sent_text:end] if end > self._sent_text else ""
        self._sent_text = max(self._sent_text, end)
        start = self._sent_ids
        ids = self.output_ids[start:]
        self._sent_ids = len(self.output_ids)
        return OutputChunk(self.rid, text, ids, self.finished, self.finish_reason, self.matched_stop, self.error,
                           self.result() if self.finished else None,
                           self.output_logprobs[start:] if self.return_logprob else None,
                           self.output_top_logprobs[start:] if self.top_logprobs_num else None)

    # ------------------------------------------------------------------ KV slots on the host

    def record_slots(self, start: int, slots: torch.Tensor) -> None:
        """Remember that positions start.. of this request's req_to_token row now hold `slots` (CPU)."""
        end = start + len(slots)
        if start > self._slots_known:  # a gap: forget the copy (req_to_token stays the truth)
            self._slots_known = 0
            return
        buf = self._slots
        if buf is None or len(buf) < end:
            grown = torch.zeros(max(end, 2 * (len(buf) if buf is not None else 0), 64), dtype=torch.int64)
            if buf is not None:
                grown[:len(buf)] = buf
            self._slots = buf = grown
        buf[start:end] = slots.to(torch.int64)
        self._slots_known = max(self._slots_known, end)

    def host_slots(self, length: int) -> torch.Tensor | None:
        """A copy of the row's first `length` slots, or None when the host does not know them all."""
        if self._slots is None or length > self._slots_known:
            return None
        return self._slots[:length].clone()

    # ------------------------------------------------------------------ retraction

    def reset_kv(self) -> None:
        """Forget KV bookkeeping after retraction; the prompt and outputs so far are recomputed later."""
        self.row, self.kv_len, self.cache_len, self.last_node, self.extend_len = 0, 0, 0, None, 0
        self.last_loc = -1
        self._slots_known = 0
        self.num_retractions += 1

    def result(self) -> dict[str, Any]:
        """The final output as Engine.generate returns it."""
        now = self.finished_time or time.perf_counter()
        return {
            "rid": self.rid,
            "text": self.text,
            "output_ids": list(self.output_ids),
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens or 0,
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "error": self.error,
            "num_retractions": self.num_retractions,
            "e2e_latency": now - self.created,
            "ttft": (self.first_token_time - self.created) if self.first_token_time else None,
            **({"output_logprobs": list(self.output_logprobs)} if self.return_logprob else {}),
            **({"output_top_logprobs": list(self.output_top_logprobs)} if self.top_logprobs_num else {}),
        }
