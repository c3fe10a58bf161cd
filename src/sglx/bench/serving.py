"""`sglx bench serving`: a streaming load generator for any OpenAI-compatible server, and its statistics.

Random prompts with input/output lengths drawn from a distribution, sent to /v1/completions (or
/v1/chat/completions) as a Poisson process (`request_rate`) and/or under a concurrency cap, all
streamed; per request we keep time to first token, the gaps between streamed chunks (inter-token
latency) and end-to-end latency. Token counts come from the server's usage report when it sends one
(stream_options.include_usage), else from the prompt builder and the number of streamed chunks.

Prompts: token ids (exact lengths; needs the vocabulary size, read from sglx's /server_info or given),
or text built from a tokenizer's vocabulary (SGLang's random dataset), or random words as a last resort.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from sglx.errors import SglxError

LENGTH_DISTS = ("uniform", "normal")
ENDPOINTS = ("completions", "chat")
PROMPT_KINDS = ("auto", "token-ids", "text")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu",
         "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega")


@dataclass(frozen=True)
class ServingBenchConfig:
    base_url: str = "http://127.0.0.1:30000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"  # completions | chat
    num_prompts: int = 200
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    max_concurrency: int | None = None  # at most this many requests in flight
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 1.0  # lengths lie in [range_ratio * len, len]; 1.0 = every request the same
    length_dist: str = "uniform"  # uniform | normal (mean mid-range, clipped to the range)
    prompt_kind: str = "auto"  # auto | token-ids | text
    tokenizer: str | None = None  # HF tokenizer directory for text prompts of known token length
    vocab_size: int | None = None  # for token-id prompts; None: ask the server's /server_info
    ignore_eos: bool = True  # generate exactly the drawn output length (a vLLM/SGLang extension)
    temperature: float = 0.0
    api_key: str | None = None
    seed: int = 0
    timeout: float = 600.0

    def __post_init__(self) -> None:
        problems = []
        if self.num_prompts < 1:
            problems.append(f"--num-prompts {self.num_prompts}: must be >= 1")
        if not self.request_rate > 0:
            problems.append(f"--request-rate {self.request_rate}: must be > 0 (inf = all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"--max-concurrency {self.max_concurrency}: must be >= 1")
        if self.input_len < 1 or self.output_len < 1:
            problems.append("--random-input-len and --random-output-len must be >= 1")
        if not 0 < self.range_ratio <= 1:
            problems.append(f"--random-range-ratio {self.range_ratio}: must be in (0, 1]")
        for flag, value, choices in (("--length-dist", self.length_dist, LENGTH_DISTS),
                                     ("--endpoint", self.endpoint, ENDPOINTS),
                                     ("--prompt-kind", self.prompt_kind, PROMPT_KINDS)):
            if value not in choices:
                problems.append(f"{flag} {value}: choose one of {', '.join(choices)}")
        if self.endpoint == "chat" and self.prompt_kind == "token-ids":
            problems.append("--prompt-kind token-ids works with --endpoint completions only (chat takes text)")
        if problems:
            raise SglxError("invalid benchmark options:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str | list[int]
    input_len: int  # as built (the server's usage count wins when it reports one)
    output_len: int


@dataclass
class RequestOutcome:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    saw_done: bool = False


# ------------------------------------------------------------------------------------------ prompts


def draw_lengths(rng: random.Random, length: int, ratio: float, dist: str, count: int) -> list[int]:
    low = max(1, int(length * ratio))
    if low >= length:
        return [length] * count
    if dist == "uniform":
        return [rng.randint(low, length) for _ in range(count)]
    mean, std = (low + length) / 2, (length - low) / 4
    return [min(length, max(low, round(rng.gauss(mean, std)))) for _ in range(count)]


def _load_tokenizer(path: str) -> Any:
    from sglx.llm.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def build_prompts(config: ServingBenchConfig, vocab_size: int | None) -> list[BenchPrompt]:
    """Random prompts of the drawn lengths: token ids, tokenizer text, or random words (in that preference)."""
    rng = random.Random(config.seed)
    ins = draw_lengths(rng, config.input_len, config.range_ratio, config.length_dist, config.num_prompts)
    outs = draw_lengths(rng, config.output_len, config.range_ratio, config.length_dist, config.num_prompts)
    kind = config.prompt_kind
    if kind == "auto":
        kind = "text" if config.tokenizer or config.endpoint == "chat" or not vocab_size else "token-ids"
    if kind == "token-ids":
        if not vocab_size:
            raise SglxError("token-id prompts need the vocabulary size: give --vocab-size, or --prompt-kind text "
                            "(with --tokenizer for exact lengths)")
        return [BenchPrompt([rng.randrange(vocab_size) for _ in range(n)], n, m) for n, m in zip(ins, outs)]
    if config.tokenizer:
        tok = _load_tokenizer(config.tokenizer)
        special = {tok.token_to_id(t) for t in tok.special_tokens.values() if t}
        ids = [i for i in range(tok.vocab_size) if i not in special]
        prompts = []
        for n, m in zip(ins, outs):
            text = tok.decode([rng.choice(ids) for _ in range(n)])
            prompts.append(BenchPrompt(text, len(tok.encode(text, add_special_tokens=False)), m))
        return prompts
    return [BenchPrompt(" ".join(rng.choice(WORDS) for _ in range(n)), n, m) for n, m in zip(ins, outs)]


def prompts_fingerprint(prompts: list[BenchPrompt]) -> str:
    """sha256 of the prompts and their output lengths: equal fingerprints mean the same requests (the offline
    bench records it too, so a serving/offline ratio is only taken over identical prompt sets)."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p.prompt, p.output_len]).encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ requests


def _headers(config: ServingBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def request_body(config: ServingBenchConfig, model: str, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.output_len, "temperature": config.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    return body


async def send_request(client: httpx.AsyncClient, config: ServingBenchConfig, model: str,
                       prompt: BenchPrompt) -> RequestOutcome:
    """One streamed request; success needs HTTP 200, no error event, and a final `data: [DONE]`."""
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    out = RequestOutcome(prompt_tokens=prompt.input_len)
    start = last = time.perf_counter()
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", path, json=request_body(config, model, prompt),
                                 headers=_headers(config)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.saw_done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {json.dumps(event['error'])[:300]}"
                    return out
                usage = event.get("usage") or usage
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.latency = time.perf_counter() - start
    if not out.saw_done:
        out.error = "the stream ended without data: [DONE]"
        return out
    if usage:
        out.prompt_tokens = int(usage.get("prompt_tokens", out.prompt_tokens))
        out.output_tokens = int(usage.get("completion_tokens", chunks))
    else:
        out.output_tokens = chunks
    out.success = True
    return out


async def _resolve(client: httpx.AsyncClient, config: ServingBenchConfig) -> tuple[str, int | None]:
    """The model id (given or the server's first) and, from sglx's /server_info, the vocabulary size."""
    model = config.model
    if model is None:
        resp = await client.get("/v1/models", headers=_headers(config))
        if resp.status_code != 200:
            raise SglxError(f"GET {config.base_url}/v1/models answered {resp.status_code}: {resp.text[:200]}; "
                            "pass --model")
        data = resp.json().get("data") or []
        if not data:
            raise SglxError(f"{config.base_url}/v1/models lists no model; pass --model")
        model = str(data[0]["id"])
    vocab = config.vocab_size
    if vocab is None and config.prompt_kind != "text":
        try:
            resp = await client.get("/server_info", headers=_headers(config))
            if resp.status_code == 200:
                vocab = resp.json().get("vocab_size")
        except (httpx.HTTPError, ValueError):
            vocab = None
    return model, vocab


async def run_benchmark(config: ServingBenchConfig,
                        on_done: Callable[[RequestOutcome], None] | None = None) -> dict[str, Any]:
    """Send every prompt, wait for all, and return the report (see `summarize`)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=config.max_concurrency or 256)
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), timeout=config.timeout,
                                 limits=limits) as client:
        try:
            model, vocab = await _resolve(client, config)
        except httpx.HTTPError as exc:
            raise SglxError(f"cannot reach {config.base_url}: {type(exc).__name__}: {exc}") from exc
        prompts = build_prompts(config, vocab)
        rng = random.Random(config.seed + 1)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        in_flight = [0, 0]  # now, peak

        async def one(p: BenchPrompt) -> RequestOutcome:
            if gate is not None:
                await gate.acquire()
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                outcome = await send_request(client, config, model, p)
            finally:
                in_flight[0] -= 1
                if gate is not None:
                    gate.release()
            if on_done is not None:
                on_done(outcome)
            return outcome

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(p)))
            if math.isfinite(config.request_rate) and i < len(prompts) - 1:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    report = summarize(config, model, outcomes, duration, in_flight[1])
    report["prompts_sha256"] = prompts_fingerprint(prompts)
    return report


# ------------------------------------------------------------------------------------------ statistics


def _nearest_rank(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def throughput_fields(completed: int, errors: list[str], duration: float, input_tokens: int,
                      output_tokens: int) -> dict[str, Any]:
    """The counts and rates both the serving and the offline report carry (so --offline-result compares like keys)."""
    return {
        "completed": completed,
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": completed / duration,
        "input_token_throughput": input_tokens / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }


def _stats(values: list[float]) -> dict[str, float]:
    """mean / median (p50) / p90 / p99 in milliseconds, percentiles by nearest rank (0 when there are no values)."""
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    return {"mean_ms": statistics.fmean(ordered) * 1e3, "median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": _nearest_rank(ordered, 0.90) * 1e3, "p99_ms": _nearest_rank(ordered, 0.99) * 1e3}


def summarize(config: ServingBenchConfig, model: str, outcomes: list[RequestOutcome], duration: float,
              peak_concurrency: int) -> dict[str, Any]:
    ok = [o for o in outcomes if o.success]
    errors = [o.error for o in outcomes if not o.success]
    input_tokens = sum(o.prompt_tokens for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    duration = max(duration, 1e-9)
    return {
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in asdict(config).items() if k != "api_key"},
        "model": model,
        **throughput_fields(len(ok), errors, duration, input_tokens, output_tokens),
        "peak_concurrency": peak_concurrency,
        "ttft": _stats([o.ttft for o in ok]),
        "itl": _stats([gap for o in ok for gap in o.itl]),
        "e2e_latency": _stats([o.latency for o in ok]),
    }
