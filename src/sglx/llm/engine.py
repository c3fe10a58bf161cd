"""`sglx.Engine`: the Python API over the runtime, used by `sglx generate`, `sglx serve` and users.

The scheduler loop runs in its own thread; `generate` (blocking, batched), `stream` (blocking
iterator) and `generate_stream` (async generator, for the HTTP server) only submit requests and wait
for their outputs, so any number of callers can share one engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sglx.errors import SglxError
from sglx.llm.engine_config import EngineConfig
from sglx.llm.loop_mailbox import MailboxRegistry
from sglx.llm.request import OutputChunk, Request
from sglx.llm.sampling import SamplingParams, make_generator

log = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, Any]]  # text, or chat messages (rendered with the chat template)
ParamsLike = SamplingParams | Mapping[str, Any] | None


class Engine:
    """An LLM engine: `Engine(model_path=..., attention_backend=..., **engine_flags)`.

    Flags are EngineConfig's fields (the CLI's `--flag-name` as `flag_name`). Use as a context manager
    or call `shutdown()` to stop the scheduler thread.
    """

    def __init__(self, config: EngineConfig | None = None, **flags: Any) -> None:
        if config is not None and flags:
            raise SglxError("pass either an EngineConfig or keyword flags, not both")
        self.config = config or EngineConfig.from_kwargs(**flags)
        sp = [f for f, v in (("--sp-size", self.config.sp_size), ("--ulysses-degree", self.config.ulysses_degree),
                             ("--ring-degree", self.config.ring_degree)) if v not in (None, 1)]
        if sp:
            raise SglxError(f"{', '.join(sp)} split a diffusion model's DiT sequence; this is an LLM (use --tp-size "
                            "to split an LLM across ranks)")
        from sglx.llm.allocator import TokenSlotAllocator
        from sglx.llm.scheduler import SchedulerConfig, build_scheduler
        from sglx.llm.tp_runtime import build_model_runner

        self.runner = build_model_runner(self.config)  # with --tp-size N: rank 0, driving N-1 worker processes
        self.model_config = self.runner.model_config
        self.tokenizer = self._load_tokenizer()
        eos = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos += [i for i in self.tokenizer.eos_token_ids if i not in eos]
        self.eos_token_ids = tuple(eos)
        mem = self.runner.memory
        self.allocator = TokenSlotAllocator(mem.num_slots, self.runner.page_size)
        self.scheduler = build_scheduler(
            self.runner, self.runner.req_to_token_pool, self.runner.token_kv_pool, self.allocator,
            SchedulerConfig(max_running_requests=mem.max_running_requests, context_length=mem.context_length,
                            max_prefill_tokens=self.config.max_prefill_tokens,
                            chunked_prefill_size=self.config.chunked_prefill,
                            enable_mixed_chunk=self.config.enable_mixed_chunk,
                            enable_overlap=not self.config.disable_overlap_schedule,
                            stream_interval=self.config.stream_interval),
            disable_radix_cache=self.config.disable_radix_cache,
        )
        self._counter = itertools.count()
        self._closed = False
        self._mailboxes = MailboxRegistry()  # streamed chunks reach each event loop in one wake-up per step
        self.scheduler.start()

    def _load_tokenizer(self) -> Any:
        from sglx.llm.tokenizer import Tokenizer

        path = self.config.tokenizer_path or self.runner.model_path
        if not Path(path).expanduser().is_dir() or not (Path(path).expanduser() / "tokenizer.json").is_file():
            if self.config.tokenizer_path:
                raise SglxError(f"--tokenizer-path {path}: no tokenizer.json there")
            return None  # shipped dummy configs: token ids only
        return Tokenizer.from_dir(path)

    # ------------------------------------------------------------------ info

    @property
    def info(self) -> dict[str, Any]:
        """What runs: model, attention backend(s), page size, KV pool size, ..."""
        return {"model_path": self.runner.model_path, "architecture": self.model_config.architecture,
                **self.runner.describe(), "radix_cache": not self.config.disable_radix_cache,
                "chunked_prefill_size": self.config.chunked_prefill,
                "overlap_schedule": not self.config.disable_overlap_schedule}

    def free_kv_slots(self) -> int:
        return int(self.scheduler.call(self.allocator.available_size))  # type: ignore[arg-type]

    def flush_cache(self) -> int:
        """Evict every unused cached prefix; returns the free KV slots afterwards."""
        def flush() -> int:
            self.scheduler.cache.evict(1 << 62)
            return self.allocator.available_size()
        return int(self.scheduler.call(flush))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: Prompt) -> list[int]:
        if self.tokenizer is None:
            raise SglxError(f"{self.runner.model_path} has no tokenizer; pass input_ids instead of text")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def failure(self) -> SglxError | None:
        """With --tp-size N: the first rank failure (one line) once the group broke, else None (/health reads it)."""
        driver = getattr(self.runner, "tp_driver", None)
        return None if driver is None else driver.workers.failure

    def _check_parallel(self) -> None:
        """With --tp-size N: raise the first worker rank's failure (one line); the engine cannot run on."""
        failure = self.failure
        if failure is not None:
            raise failure

    def _make_request(self, prompt: Prompt | None, input_ids: Sequence[int] | None, params: ParamsLike,
                      on_output: Any, stream: bool, return_logprob: bool = False, top_logprobs: int = 0) -> Request:
        if self._closed:
            raise SglxError("this engine was shut down")
        self._check_parallel()
        p = SamplingParams.from_any(params)
        if input_ids is None:
            if prompt is None:
                raise SglxError("give a prompt or input_ids")
            input_ids = self.encode(prompt)
        ids = [int(t) for t in input_ids]
        if not ids:
            raise SglxError("the prompt is empty (0 tokens)")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise SglxError(f"token ids out of range for vocab size {self.model_config.vocab_size}: {bad[:5]}")
        capacity = self.scheduler.capacity()
        if len(ids) >= capacity:
            raise SglxError(f"the prompt has {len(ids)} tokens; this engine takes at most {capacity - 1} "
                            f"(context length {self.runner.memory.context_length}, KV pool "
                            f"{self.runner.memory.num_slots} tokens). Raise --context-length/--max-total-tokens "
                            "or shorten the prompt.")
        n = next(self._counter)
        seed = p.seed if p.seed is not None else (self.config.seed * 1_000_003 + n)
        decoder = None
        if self.tokenizer is not None:
            from sglx.llm.tokenizer import IncrementalDecoder

            decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=p.skip_special_tokens)
        return Request(uuid.uuid4().hex, ids, p, decoder=decoder, generator=make_generator(seed, self.runner.device),
                       eos_token_ids=self.eos_token_ids, on_output=on_output, stream=stream,
                       return_logprob=return_logprob or top_logprobs > 0, top_logprobs_num=max(0, int(top_logprobs)))

    def generate(self, prompt: Prompt | Sequence[Prompt] | None = None, sampling_params: Any = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_logprob: bool = False) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list, run as one batch).

        sampling_params: a SamplingParams or dict, or a list of them (one per prompt). A prompt is text
        or a list of chat messages; `input_ids` takes token ids instead.
        """
        single = _is_single(prompt, input_ids)
        prompts: list[Any]
        if input_ids is not None:
            prompts = [list(input_ids)] if single else [list(x) for x in input_ids]  # type: ignore[arg-type]
        else:
            prompts = [prompt] if single else list(prompt)  # type: ignore[arg-type]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise SglxError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        if not prompts:
            return []
        results: list[dict[str, Any] | None] = [None] * len(prompts)
        remaining = [len(prompts)]
        done = threading.Event()
        lock = threading.Lock()

        def collector(i: int) -> Any:
            def on_output(chunk: OutputChunk) -> None:
                if chunk.finished:
                    with lock:
                        results[i] = chunk.result
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            done.set()
            return on_output

        reqs = [self._make_request(None if input_ids is not None else pr, pr if input_ids is not None else None,
                                   params_list[i], collector(i), False, return_logprob)
                for i, pr in enumerate(prompts)]
        for req in reqs:
            self.scheduler.submit(req)
        try:
            while not done.wait(0.1):
                self._check_parallel()
                if self._closed or not self.scheduler.alive:
                    raise SglxError("the engine stopped before the requests finished")
        except KeyboardInterrupt:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        self._check_parallel()
        out = [r for r in results if r is not None]
        return out[0] if single else out

    def stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
               input_ids: Sequence[int] | None = None) -> Iterator[dict[str, Any]]:
        """Submit now; iterate chunks {"text", "output_ids", "finished", ...}, the last one with "result".

        Several streams can be opened before reading any: their requests run batched together.
        """
        q: queue.SimpleQueue[OutputChunk] = queue.SimpleQueue()
        req = self._make_request(prompt, input_ids, sampling_params, q.put, True)
        self.scheduler.submit(req)
        return self._iter_chunks(q, req.rid)

    def _iter_chunks(self, q: queue.SimpleQueue[OutputChunk], rid: str) -> Iterator[dict[str, Any]]:
        finished = False
        try:
            while not finished:
                try:
                    chunk = q.get(timeout=0.5)
                except queue.Empty:
                    self._check_parallel()
                    if self._closed or not self.scheduler.alive:
                        raise SglxError("the engine stopped before the request finished") from None
                    continue
                finished = chunk.finished
                if finished:
                    self._check_parallel()
                yield chunk_dict(chunk)
        finally:
            if not finished:
                self.scheduler.abort(rid)

    async def generate_stream(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
                              input_ids: Sequence[int] | None = None,
                              return_logprob: bool = False, top_logprobs: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Async generator of chunks for one request (the HTTP server's streaming path).

        Leaving the loop early (client disconnect, cancellation) aborts the request in the engine.
        With return_logprob, chunks carry "logprobs" (and "top_logprobs": (id, logprob) pairs) of their tokens.
        """
        mailbox = self._mailboxes.for_loop(asyncio.get_running_loop())
        q: asyncio.Queue[OutputChunk] = asyncio.Queue()

        def on_output(chunk: OutputChunk) -> None:
            mailbox.put(q, chunk)

        req = self._make_request(prompt, input_ids, sampling_params, on_output, True, return_logprob, top_logprobs)
        self.scheduler.submit(req)
        finished = False
        try:
            while not finished:
                chunk = await q.get()
                finished = chunk.finished
                yield chunk_dict(chunk)
        finally:
            if not finished:
                self.scheduler.abort(req.rid)

    def submit(self, input_ids: Sequence[int], sampling_params: ParamsLike, on_output: Callable[[OutputChunk], None],
               stream: bool = True, return_logprob: bool = False, top_logprobs: int = 0) -> str:
        """Queue one request of token ids; `on_output` gets its chunks on the scheduler thread. Returns its rid,
        for `abort`. The server's engine process (sglx.server.engine_process) drives the engine this way."""
        req = self._make_request(None, input_ids, sampling_params, on_output, stream, return_logprob, top_logprobs)
        self.scheduler.submit(req)
        return req.rid

    def abort(self, rid: str) -> None:
        """End a submitted request early (its KV is freed; its last chunk says finish_reason "abort")."""
        self.scheduler.abort(rid)

    async def async_generate(self, prompt: Prompt | None = None, sampling_params: ParamsLike = None,
                             input_ids: Sequence[int] | None = None, return_logprob: bool = False
                             ) -> dict[str, Any]:
        """The final result of one request, awaited without blocking the event loop."""
        result: dict[str, Any] | None = None
        async for chunk in self.generate_stream(prompt, sampling_params, input_ids, return_logprob):
            result = chunk.get("result") or result
        assert result is not None
        return result

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the scheduler thread and free the model and KV memory (a new Engine can take the GPU)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.stop()
        if self.scheduler.alive:  # a step is still running; its memory goes when the thread ends
            driver = getattr(self.runner, "tp_driver", None)
            if driver is not None:  # but no worker rank may outlive the engine
                driver.workers.shutdown()
            return
        self.scheduler.release_memory()
        self.runner.release_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort: a forgotten engine should not leave its thread spinning
        with contextlib.suppress(Exception):
            self.shutdown()


def _is_single(prompt: Any, input_ids: Any) -> bool:
    if input_ids is not None:
        return not input_ids or isinstance(input_ids[0], int)
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        return True  # one chat conversation
    if prompt is None:
        raise SglxError("give a prompt or input_ids")
    return False


def chunk_dict(chunk: OutputChunk) -> dict[str, Any]:
    """A chunk as the streaming APIs yield it (the server's engine process sends these too)."""
    out: dict[str, Any] = {"rid": chunk.rid, "text": chunk.text, "output_ids": chunk.token_ids,
                           "finished": chunk.finished, "finish_reason": chunk.finish_reason}
    if chunk.logprobs is not None:
        out["logprobs"] = chunk.logprobs
    if chunk.top_logprobs is not None:
        out["top_logprobs"] = chunk.top_logprobs
    if chunk.finished:
        out["matched_stop"] = chunk.matched_stop
        out["error"] = chunk.error
        out["result"] = chunk.result
    return out
