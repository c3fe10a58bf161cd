"""Sampling parameters and the batched sampler.

Every request samples from its own `torch.Generator`, seeded by its `seed` (or by the engine's seed
and the request's arrival order), so a request's output does not depend on which other requests
share its batches: the same seed gives the same text alone or under load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from sglx.errors import SglxError

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/SGLang-style knobs; temperature 0 (or top_k 1) means greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        problems = []
        if self.max_new_tokens < 0:
            problems.append(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:
            problems.append(f"top_k must be -1 (off) or >= 1 (got {self.top_k})")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2] (got {getattr(self, name)})")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise SglxError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_any(cls, value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """Accept a SamplingParams, a dict of its fields (unknown keys are an error) or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SglxError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**dict(value))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """Penalties for one request's logits row [V] (float32)."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(list({*prompt_ids, *output_ids}), dtype=torch.long, device=device)
        if seen.numel():
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                       picked * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long, device=device),
                                minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [bs, V] after temperature, top-k, top-p and min-p (batched, one value per row)."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    drop = ranks >= k[:, None]
    cumulative = sorted_probs.cumsum(dim=-1)
    drop |= (cumulative - sorted_probs) > top_p[:, None]  # keep the smallest set whose mass reaches top_p
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
           greedy_ids: torch.Tensor | None = None) -> list[int]:
    """Next token of every request from its logits row [bs, V] (read back to the host: one device sync)."""
    return sample_tokens(logits, params, generators, prompt_ids, output_ids, greedy_ids).tolist()


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None], prompt_ids: Sequence[Sequence[int]],
                  output_ids: Sequence[Sequence[int]], greedy_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Next token of every request as a device tensor [bs] (int64): no host sync, so the overlap scheduler
    can launch the next step before reading it.

    greedy_ids: the rows' argmax if already computed (inside the decode CUDA graph); used when no
    penalty changes the logits.
    """
    logits = logits.float()
    penalties = any(p.has_penalties for p in params)
    if penalties:
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.has_penalties:
                apply_penalties(logits[i], p, prompt_ids[i], output_ids[i])
    out = greedy_ids if greedy_ids is not None and not penalties else logits.argmax(dim=-1)
    out = out.to(torch.long)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    out = out.clone()  # never write into a CUDA graph's static argmax output
    device = logits.device
    sub = logits[rows]
    # host lists go to the device with non_blocking copies (a blocking one would wait for the device)
    temperature = _on(device, [params[i].temperature for i in rows])
    top_k = _on(device, [params[i].top_k for i in rows])
    top_p = _on(device, [params[i].top_p for i in rows])
    min_p = _on(device, [params[i].min_p for i in rows])
    probs = filtered_probs(sub, temperature, top_k, top_p, min_p)
    picks = torch.cat([torch.multinomial(probs[j], 1, generator=generators[i]) for j, i in enumerate(rows)])
    out[_on(device, rows)] = picks.to(torch.long)
    return out


def _on(device: torch.device, values: list) -> torch.Tensor:
    """A small host list as a device tensor, without the host waiting for the device's queued work."""
    return torch.tensor(values).to(device, non_blocking=True)
