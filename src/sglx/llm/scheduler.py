"""Continuous batching: every step picks EXTEND, DECODE or MIXED work, runs it and advances requests.

The loop follows SGLang's scheduler: waiting requests are admitted (prefix-matched in the cache,
chunked to `chunked_prefill_size`, limited by `max_running_requests`, `max_prefill_tokens` and free
KV memory with a reserve for the decodes already running); a prefill step runs when anything was
admitted, mixed with the running decodes when `enable_mixed_chunk` is on; otherwise all running
requests decode one token. When a decode step cannot get KV slots even after evicting cached
prefixes, requests are retracted (their KV handed to the prefix cache or freed, the request requeued
with its outputs so far) and recomputed later, so memory pressure slows requests but never breaks one.

With `enable_overlap` (SGLang's overlap scheduler, sglx.llm.overlap) the host schedules and launches
step n+1 before it reads step n's sampled tokens, which reach step n+1's inputs through a device-side
future-token map; outputs are processed one step late.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sglx.llm.allocator import TokenSlotAllocator
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
from sglx.llm.overlap import FutureTokenMap, StepOutput, record_event, to_host
from sglx.llm.radix_cache import PrefixCache
from sglx.llm.request import Request
from sglx.llm.sampling import sample_tokens

log = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's decode reserve, as in SGLang


class BatchRunner(Protocol):
    """Runs one ForwardBatch through the model: float32 logits [batch_size, vocab] (each request's last token)."""

    device: torch.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    context_length: int
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 8192  # None or <= 0: no chunking
    enable_mixed_chunk: bool = False
    init_new_token_ratio: float = 0.7  # fraction of each running request's remaining tokens kept in reserve
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    enable_overlap: bool = True  # launch step n+1 before reading step n's tokens (--disable-overlap-schedule)
    stream_interval: int = 1  # a streamed request's chunk every this many tokens (first token and end at once)


@dataclass
class SchedulerStats:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    chunked_steps: int = 0  # steps that ran a partial prefill chunk
    retractions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    max_running: int = 0
    max_batch_tokens: int = 0
    modes: list[str] = field(default_factory=list)  # per step, only while `record_modes` is set


class Scheduler:
    def __init__(self, runner: BatchRunner, req_to_token_pool: ReqToTokenPool, token_kv_pool: TokenKVPool,
                 allocator: TokenSlotAllocator, cache: PrefixCache, config: SchedulerConfig) -> None:
        self.runner = runner
        self.req_to_token_pool = req_to_token_pool
        self.token_kv_pool = token_kv_pool
        self.allocator = allocator
        self.cache = cache
        self.config = config
        self.page_size = allocator.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked_req: Request | None = None
        self._batch: list[Request] = []
        self._pending: StepOutput | None = None  # overlap: the launched step whose tokens the host has not read
        self.future_map = (FutureTokenMap(config.max_running_requests, runner.device)
                           if config.enable_overlap else None)
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self.record_modes = False
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.after_step: Callable[[], None] | None = None  # run by the loop thread after each iteration

    # ------------------------------------------------------------------ thread-safe entry points

    def submit(self, req: Request) -> None:
        self._inbox.put(("add", req))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[], object], timeout: float | None = 60.0) -> object:
        """Run fn inside the scheduler loop (between steps) and return its result: safe access to pools."""
        if self._thread is None or not self._thread.is_alive():
            return fn()
        box: list[object] = []
        done = threading.Event()
        self._inbox.put(("call", (fn, box, done)))
        if not done.wait(timeout):
            raise TimeoutError("the scheduler did not answer")
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def start(self) -> None:
        """Run the loop in a daemon thread (the engine's); requests arrive through submit()."""
        self._thread = threading.Thread(target=self.run_forever, name="sglx-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            busy = self.has_work()
            self._drain_inbox(block=not busy)
            if self._stop.is_set():
                break
            try:
                self.step()
            except Exception as exc:  # one broken step must not kill the engine: fail its requests instead
                log.exception("scheduler step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
            self._after_step()
        self._fail_all("the engine was shut down")
        self._after_step()

    def _after_step(self) -> None:
        """Call `after_step` (if set): the loop's outputs of this iteration are all emitted, so a caller that
        buffers them (the server's engine process) can ship them in one message per step."""
        if self.after_step is not None:
            try:
                self.after_step()
            except Exception:
                log.exception("after_step callback failed")

    def release_memory(self) -> None:
        """Drop the references to pools and runner after stop(), so their device memory can be freed."""
        self.runner = None  # type: ignore[assignment]
        self.req_to_token_pool = self.token_kv_pool = None  # type: ignore[assignment]
        self.cache.req_to_token_pool = None  # type: ignore[assignment]

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._pending)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Synchronous driving (tests, offline use): step until every submitted request has finished."""
        for _ in range(max_steps):
            self._drain_inbox(block=False)
            if not self.has_work():
                return
            self.step()
        raise RuntimeError("scheduler did not become idle")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._add(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                self._abort(payload)  # type: ignore[arg-type]
            elif kind == "call":
                fn, box, done = payload  # type: ignore[misc]
                try:
                    box.append(fn())
                except Exception as exc:  # handed back to the caller's thread
                    box.append(exc)
                done.set()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------------ request lifecycle

    def capacity(self) -> int:
        """Tokens one request may occupy at most (the whole pool, within the context length)."""
        return min(self.allocator.num_slots, self.config.context_length)

    def _add(self, req: Request) -> None:
        problem = None
        if not req.input_ids:
            problem = "the prompt is empty"
        elif len(req.input_ids) >= self.capacity():
            problem = (f"the prompt has {len(req.input_ids)} tokens; this engine holds at most "
                       f"{self.capacity() - 1} prompt tokens (context length {self.config.context_length}, "
                       f"KV pool {self.allocator.num_slots} tokens)")
        if problem is not None:
            req.finish("abort", error=problem)
            self._emit(req)
            return
        req.max_new_tokens = min(req.max_new_tokens, self.config.context_length - len(req.input_ids))
        if req.params.max_new_tokens == 0:
            req.finish("length")
            self._emit(req)
            return
        self.stats.prompt_tokens += len(req.input_ids)
        self.waiting.append(req)

    def _abort(self, rid: str) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish("abort", error="aborted")
                self._emit(req)
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.rid == rid:
                req.finish("abort", error="aborted")  # released at the end of the next step

    def _release(self, req: Request) -> None:
        """Give the request's KV to the prefix cache (or free it) and its req_to_token row back."""
        if req.row:
            self.cache.cache_finished_req(req)
            self.req_to_token_pool.free(req.row)
        req.row = 0

    def _emit(self, req: Request) -> None:
        if req.on_output is None:
            return
        if req.finished or (req.stream and req.has_new_output and (
                req.unsent_tokens >= self.config.stream_interval or req.unsent_tokens == len(req.output_ids))):
            try:
                req.on_output(req.take_chunk())
            except Exception:  # a caller's broken callback (e.g. a closed event loop) ends only its request
                log.exception("output callback of request %s failed; aborting it", req.rid)
                req.on_output = None
                req.finish("abort", error="the output callback failed")

    def _fail_all(self, message: str) -> None:
        # a step in flight also holds requests that already finished (and were told): leave those alone
        pending = [r for r in self._pending.reqs if not r.finished] if self._pending is not None else []
        reqs = list({id(r): r for r in [*self._batch, *pending, *self.waiting, *self.running,
                                         *([self.chunked_req] if self.chunked_req else [])]}.values())
        self._batch = []
        self._pending = None
        self.waiting.clear()
        self.running = []
        self.chunked_req = None
        for req in reqs:
            try:
                if req.row:  # KV of a failed step may be garbage: free it, never cache it
                    self.cache.drop_req(req, req.kv_len + req.extend_len)
                    self.req_to_token_pool.free(req.row)
                    req.row = 0
            except Exception:  # bookkeeping may be inconsistent after a failed step; report, don't raise
                log.exception("releasing request %s failed", req.rid)
            req.finish("abort", error=message)
            self._emit(req)

    # ------------------------------------------------------------------ memory

    def _ensure_pages(self, pages: int) -> bool:
        short = pages - self.allocator.free_pages
        if short > 0:
            self.cache.evict(short * self.page_size)
        return self.allocator.free_pages >= pages

    def _last_locs(self, reqs: list[Request]) -> list[int]:
        """Slot of each request's last computed token (0 if none): kept on the host after each allocation, read
        from req_to_token (one gather, one device sync) only after a prefix match. One-token pages need none."""
        ps = self.page_size
        if ps == 1:
            return [0] * len(reqs)
        unknown = [r for r in reqs if r.kv_len % ps and r.last_loc < 0]  # page-aligned prefixes need none
        if unknown:
            table = self.req_to_token_pool.req_to_token
            rows = torch.tensor([r.row for r in unknown], dtype=torch.long, device=table.device)
            cols = torch.tensor([r.kv_len - 1 for r in unknown], dtype=torch.long, device=table.device)
            for r, loc in zip(unknown, table[rows, cols].tolist()):
                r.last_loc = int(loc)
        return [r.last_loc if r.kv_len % ps else 0 for r in reqs]

    def _alloc(self, reqs: list[Request]) -> torch.Tensor | None:
        """Slots for every request's scheduled extend_len tokens, written into req_to_token; None if short."""
        prefix = [r.kv_len for r in reqs]
        seq = [r.kv_len + r.extend_len for r in reqs]
        if not self._ensure_pages(self.allocator.pages_needed(prefix, seq)):
            return None
        locs = self.allocator.alloc_extend(prefix, seq, self._last_locs(reqs))
        if locs is None:
            return None
        table = self.req_to_token_pool.req_to_token
        rows = torch.repeat_interleave(torch.tensor([r.row for r in reqs]), torch.tensor([r.extend_len for r in reqs]))
        cols = torch.cat([torch.arange(r.kv_len, r.kv_len + r.extend_len) for r in reqs])
        # non_blocking: a pageable host source is staged at once, so the host never waits for the device
        table[rows.to(table.device, non_blocking=True), cols.to(table.device, non_blocking=True)] = \
            locs.to(table.device, table.dtype, non_blocking=True)
        offset = 0
        for r in reqs:
            r.step_locs = locs[offset:offset + r.extend_len]
            offset += r.extend_len
            if r.extend_len:
                r.last_loc = int(locs[offset - 1])
                r.record_slots(r.kv_len, r.step_locs)
        return locs

    def _reserve(self, req: Request) -> int:
        left = max(0, req.max_new_tokens - len(req.output_ids) - req.pending_tokens)
        return int(min(left, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    # ------------------------------------------------------------------ scheduling

    def _schedule_prefill(self) -> list[Request]:
        """Admit (and allocate) the extend part of the next step: the chunked request first, then waiting ones."""
        cfg = self.config
        chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size and cfg.chunked_prefill_size > 0 else None
        token_budget = cfg.max_prefill_tokens
        if chunk is not None:
            token_budget = min(token_budget, chunk)
        batch: list[Request] = []

        if self.chunked_req is not None and self.chunked_req.finished:  # aborted between chunks
            req, self.chunked_req = self.chunked_req, None
            self._release(req)
            self._emit(req)
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            n = self._chunk_len(req.remaining, token_budget, chunk)
            req.extend_len = n
            if self._alloc([req]) is None:
                self._retract_extending(req)
                return []
            batch.append(req)
            token_budget -= n
            if n < req.remaining:
                self.chunked_req = req
                return batch

        headroom = self.allocator.available_size() + self.cache.evictable_size()
        headroom -= sum(self._reserve(r) for r in self.running)
        while self.waiting and token_budget > 0:
            if len(self.running) + len(batch) >= cfg.max_running_requests or not self.req_to_token_pool.available:
                break
            req = self.waiting[0]
            nothing_else = not self.running and not batch
            slots, node = self.cache.match_prefix(req.fill_ids[:-1])
            m = len(slots)
            remaining = req.seq_len - m
            n = self._chunk_len(remaining, token_budget, chunk)
            if n < remaining and chunk is None and nothing_else:
                n = remaining  # no chunking: the first request runs whole even beyond max_prefill_tokens
            elif n < remaining and chunk is None:
                break
            need = n + (self._reserve(req) if n == remaining else 0)
            if need > headroom and not nothing_else:
                break
            evictable = self.cache.evictable_size()
            self.cache.lock(node)
            req.row = self.req_to_token_pool.alloc() or 0
            if m:
                table = self.req_to_token_pool.req_to_token
                table[req.row, :m] = slots.to(table.device, table.dtype, non_blocking=True)
                req.record_slots(0, slots.to("cpu"))
            req.kv_len = req.cache_len = m
            req.last_loc = -1
            req.last_node, req.extend_len = node, n
            if self._alloc([req]) is None:
                self.cache.unlock(node)
                self.req_to_token_pool.free(req.row)
                req.row, req.kv_len, req.cache_len, req.last_node, req.extend_len = 0, 0, 0, None, 0
                if nothing_else and self.chunked_req is None:  # alone and still too big: it can never run
                    self.waiting.popleft()
                    req.finish("length" if req.output_ids else "abort",
                               error=f"the KV pool ({self.allocator.num_slots} tokens) cannot hold this request")
                    self._emit(req)
                    continue
                break
            headroom -= evictable - self.cache.evictable_size()
            self.waiting.popleft()
            if req.cached_tokens is None:
                req.cached_tokens = m
                self.stats.cached_tokens += m
            batch.append(req)
            headroom -= need
            token_budget -= n
            if n < remaining:
                self.chunked_req = req
                break
        return batch

    def _chunk_len(self, remaining: int, budget: int, chunk: int | None) -> int:
        if remaining <= budget:
            return remaining
        ps = self.page_size
        n = budget - budget % ps if budget >= ps else budget
        return max(1, n)

    def _retract_extending(self, req: Request) -> None:
        """A chunked prefill that cannot continue: requeue it first unless it is alone (then it cannot fit)."""
        if self.running or self.cache.evictable_size():
            self._retract(req)
            return
        self._release(req)
        req.finish("abort", error=f"the KV pool ({self.allocator.num_slots} tokens) cannot hold this request")
        self._emit(req)

    def _retract(self, req: Request) -> None:
        self._release(req)
        req.reset_kv()
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.new_token_ratio = 1.0

    def _prepare_decode(self, may_retract: bool = True) -> list[Request]:
        """Allocate one slot per running request, retracting requests while KV memory is short.

        In a MIXED step (may_retract False) short memory just leaves the decodes for a later step.
        """
        while self.running:
            need = self.allocator.pages_needed([r.kv_len for r in self.running],
                                               [r.kv_len + 1 for r in self.running])
            if self._ensure_pages(need):
                break
            if not may_retract:
                return []
            if self._pending is not None:  # read the step in flight first: it may end requests and free KV
                self._resolve_pending()
                continue
            if len(self.running) == 1:
                req = self.running.pop()
                self._release(req)
                req.finish("length", error=f"the KV pool ({self.allocator.num_slots} tokens) is full")
                self._emit(req)
                return []
            # SGLang's order: retract the request with the fewest outputs, longest prompt first.
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self.running.remove(victim)
            self._retract(victim)
        if not self.running:
            return []
        for req in self.running:
            req.extend_len = 1
        if self._alloc(self.running) is None:
            raise RuntimeError("KV allocator refused pages it reported free")
        return list(self.running)

    def step(self) -> None:
        """One scheduling step: take new requests, admit, launch the model once, then read a step's tokens.

        Without overlap the step just launched is read at once. With overlap the tokens read are those of
        the previous step, so the host schedules and launches this step while the device still runs that one.
        """
        self._drain_inbox(block=False)
        self._drop_finished_running()
        if self._pending is not None and self._needs_tokens_on_host():
            self._resolve_pending()
        launched = self._launch()
        previous, self._pending = self._pending, launched
        if previous is not None:
            self._resolve(previous)
        if self.future_map is None:
            self._resolve_pending()

    def _needs_tokens_on_host(self) -> bool:
        """Penalties read each request's output ids on the host: such batches wait for the step in flight."""
        return any(r.pending_tokens and r.params.has_penalties for r in self.running)

    def _resolve_pending(self) -> None:
        out, self._pending = self._pending, None
        if out is not None:
            self._resolve(out)

    def _launch(self) -> StepOutput | None:
        """Schedule and launch one forward plus sampling; returns its pending output (None: nothing to run)."""
        extend = self._schedule_prefill()
        if extend:
            decode = self._prepare_decode(may_retract=False) if self.config.enable_mixed_chunk and self.running else []
            mode = ForwardMode.MIXED if decode else ForwardMode.EXTEND
        else:
            decode = self._prepare_decode()
            mode = ForwardMode.DECODE
        reqs = extend + decode
        if not reqs:
            return None
        self._batch = reqs  # in no queue while the step runs: _fail_all must still find them
        if not extend:
            self.new_token_ratio = max(self.config.min_new_token_ratio,
                                       self.new_token_ratio - self.config.new_token_ratio_decay)
        batch = self._build_batch(reqs, mode)
        logits = self.runner.forward(batch)
        self._record(mode, reqs, batch)
        out = self._advance(reqs, decode, logits)
        self._batch = []
        return out

    def _drop_finished_running(self) -> None:
        """Requests aborted between steps leave the running set before the next step is formed."""
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self._release(req)
            self._emit(req)

    def _build_batch(self, reqs: list[Request], mode: ForwardMode) -> ForwardBatch:
        device = self.runner.device
        ids: list[int] = []
        positions: list[int] = []
        futures = False
        for r in reqs:
            if r.pending_tokens:  # a decode whose input token is still on the device: its placeholder
                ids.append(-r.future)
                futures = True
            else:
                ids.extend(r.fill_slice(r.kv_len, r.kv_len + r.extend_len))
            positions.extend(range(r.kv_len, r.kv_len + r.extend_len))
        seq_lens = [r.kv_len + r.extend_len for r in reqs]
        input_ids = _to_device(ids, device)
        if futures:
            assert self.future_map is not None, "placeholders exist only with overlap scheduling"
            input_ids = self.future_map.resolve(input_ids)
        return ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=_to_device(positions, device),
            req_pool_indices=_to_device([r.row for r in reqs], device),
            seq_lens=_to_device(seq_lens, device),
            out_cache_loc=torch.cat([r.step_locs for r in reqs]).to(device=device, dtype=torch.long,
                                                                      non_blocking=True),
            req_to_token_pool=self.req_to_token_pool,
            token_kv_pool=self.token_kv_pool,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[r.extend_len for r in reqs] if mode.is_extend else [],
            extend_prefix_lens_cpu=[r.kv_len for r in reqs] if mode.is_extend else [],
        )

    def _record(self, mode: ForwardMode, reqs: list[Request], batch: ForwardBatch) -> None:
        s = self.stats
        s.steps += 1
        if mode is ForwardMode.EXTEND:
            s.extend_steps += 1
        elif mode is ForwardMode.DECODE:
            s.decode_steps += 1
        else:
            s.mixed_steps += 1
        if self.chunked_req is not None:
            s.chunked_steps += 1
        s.max_batch_tokens = max(s.max_batch_tokens, batch.num_tokens)
        if self.record_modes:
            s.modes.append(mode.value)

    def _advance(self, reqs: list[Request], decode: list[Request], logits: torch.Tensor) -> StepOutput:
        """After the launch: sample on the device, and do the bookkeeping that needs no token value (KV
        lengths, prefix cache, the running set). The tokens stay on the device until `_resolve`."""
        sampled_rows: list[int] = []
        for i, req in enumerate(reqs):
            req.kv_len += req.extend_len
            req.extend_len = 0
            if req.remaining == 0:
                sampled_rows.append(i)
        picked = [reqs[i] for i in sampled_rows]
        out = StepOutput(reqs, set(map(id, decode)), picked, [])
        if picked:
            every = len(picked) == len(reqs)
            rows = logits if every else logits[_to_device(sampled_rows, logits.device)]
            # argmax made inside the decode graph, when the runner has one (test doubles need not)
            greedy = getattr(self.runner, "last_greedy_ids", None) if every else None
            tokens = sample_tokens(rows, [r.params for r in picked], [r.generator for r in picked],
                                   [r.input_ids for r in picked], [r.output_ids for r in picked], greedy_ids=greedy)
            if any(r.return_logprob for r in picked):
                all_logprobs = torch.log_softmax(rows.float(), dim=-1)
                out.logprobs = to_host(all_logprobs.gather(1, tokens[:, None])[:, 0])
                k = max(r.top_logprobs_num for r in picked)
                if k > 0:
                    values, ids = all_logprobs.topk(min(k, all_logprobs.shape[-1]), dim=-1)
                    out.top_ids, out.top_values = to_host(ids), to_host(values)
            if self.future_map is not None:
                out.entries = self.future_map.reserve(len(picked))
                self.future_map.store(out.entries, tokens)
            else:
                out.entries = [0] * len(picked)
            out.tokens = to_host(tokens)
            out.event = record_event(tokens.device)
            for req, entry in zip(picked, out.entries):
                req.pending_tokens += 1
                req.future = entry
        for req in reqs:
            if req.finished:
                continue
            if req is self.chunked_req:
                self.cache.cache_unfinished_req(req)
            elif id(req) not in out.decode_ids:
                self.cache.cache_unfinished_req(req)
                self.running.append(req)
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        return out

    def _resolve(self, out: StepOutput) -> None:
        """Read a launched step's tokens: append them, check stop conditions, stream, finish requests."""
        done_before = {id(r) for r in out.reqs if r.finished}  # aborted meanwhile: already released and told
        tokens, logprobs, top = out.wait()
        for j, (req, token) in enumerate(zip(out.sampled, tokens)):
            if req.finished:
                continue
            req.pending_tokens -= 1
            if req.future == out.entries[j]:
                req.future = 0
            if logprobs is not None and req.return_logprob:
                req.output_logprobs.append(logprobs[j])
                if top is not None and req.top_logprobs_num:
                    req.output_top_logprobs.append(top[j][:req.top_logprobs_num])
            req.append_token(int(token))
            self.stats.generated_tokens += 1
            if req.finished:
                self._finish_sampled(req)
        for req in out.reqs:
            if id(req) not in done_before:
                self._emit(req)

    def _finish_sampled(self, req: Request) -> None:
        """A request that its latest token finished: leave the running set, give back its KV.

        With overlap it was already launched in one more decode step (its token is discarded): that step's
        KV slot is freed too, so the cache and the pool end as they would without overlap."""
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        extra = req.kv_len - (len(req.input_ids) + len(req.output_ids) - 1)
        if extra > 0 and req.row:
            self._drop_extra_kv(req, extra)
        req.pending_tokens, req.future = 0, 0
        self._release(req)

    def _drop_extra_kv(self, req: Request, extra: int) -> None:
        """Forget the KV of the last `extra` positions (the discarded step's); free the pages only they use."""
        assert req.step_locs is not None and len(req.step_locs) >= extra, "the extra step's slots are its latest"
        target = req.kv_len - extra
        slots = req.step_locs[len(req.step_locs) - extra:].tolist()
        own_pages = [slot for pos, slot in zip(range(target, req.kv_len), slots) if pos % self.page_size == 0]
        self.allocator.free(own_pages)  # pages shared with earlier positions go with the rest of the request
        req.kv_len = target


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor on the device without the host waiting for the device (a pageable source is staged)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def build_scheduler(runner: BatchRunner, req_to_token_pool: ReqToTokenPool, token_kv_pool: TokenKVPool,
                    allocator: TokenSlotAllocator, config: SchedulerConfig, disable_radix_cache: bool = False,
                    cache_factory: Callable[..., PrefixCache] | None = None) -> Scheduler:
    """A scheduler with the radix cache (or none with disable_radix_cache)."""
    from sglx.llm.radix_cache import NoPrefixCache, RadixCache

    factory = cache_factory or (NoPrefixCache if disable_radix_cache else RadixCache)
    cache = factory(allocator, req_to_token_pool)
    return Scheduler(runner, req_to_token_pool, token_kv_pool, allocator, cache, config)
