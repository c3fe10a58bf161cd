"""Scheduler with a model that reads its whole context back from the paged KV pool.

The fake model stores (token, position) of every token at its KV slot and predicts the next token as
a hash of the context it reads back through req_to_token. Any wrong slot, overwritten page, lost
prefix or misplaced chunk changes the hash, so comparing against the hash of the plain token list
checks the scheduler, allocator and prefix cache end to end, fast, without a real model.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from sglx.llm.allocator import TokenSlotAllocator
from sglx.llm.forward_batch import ForwardBatch
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
from sglx.llm.request import OutputChunk, Request
from sglx.llm.sampling import SamplingParams
from sglx.llm.scheduler import Scheduler, SchedulerConfig, build_scheduler

VOCAB = 101


def reference_next(tokens: list[int]) -> int:
    return sum(t * (i + 1) for i, t in enumerate(tokens)) % VOCAB


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(reference_next(seq))
    return seq[len(prompt):]


class HashModel:
    device = torch.device("cpu")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.token_kv_pool
        k = torch.stack([batch.input_ids.float(), batch.positions.float()], dim=-1)[:, None, :]
        pool.set_kv(0, batch.out_cache_loc, k, k)
        logits = torch.full((batch.batch_size, VOCAB), -1.0)
        for i, (row, length) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu)):
            slots = batch.req_to_token_pool.req_to_token[row, :length].long()
            kv, _ = pool.get_kv(0, slots)
            toks, pos = kv[:, 0, 0].long(), kv[:, 0, 1].long()
            assert pos.tolist() == list(range(length)), "KV read back at the wrong positions"
            logits[i, reference_next(toks.tolist())] = 1.0
        return logits


def make(num_slots: int = 512, page_size: int = 1, max_running: int = 8, chunk: int | None = None,
         mixed: bool = False, radix: bool = True, **cfg) -> Scheduler:
    r2t = ReqToTokenPool(max_running, 256)
    kv = TokenKVPool(num_slots, page_size, 1, 1, 2, torch.float32)
    alloc = TokenSlotAllocator(num_slots, page_size)
    config = SchedulerConfig(max_running_requests=max_running, context_length=256, chunked_prefill_size=chunk,
                             enable_mixed_chunk=mixed, **cfg)
    return build_scheduler(HashModel(), r2t, kv, alloc, config, disable_radix_cache=not radix)


def submit(s: Scheduler, prompt: list[int], n: int, rid: str | None = None, **params) -> Request:
    req = Request(rid or f"r{random.random()}", prompt, SamplingParams(max_new_tokens=n, temperature=0.0, **params))
    s.submit(req)
    return req


def drained(s: Scheduler) -> bool:
    """Everything is returned once the cache gives back what it holds."""
    s.cache.evict(10**9)
    return s.allocator.free_pages == s.allocator.num_pages and s.req_to_token_pool.available == s.req_to_token_pool.size


def prompts(seed: int, count: int, lo: int = 3, hi: int = 40, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(shared)]
    return [head + [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("radix", [True, False])
def test_batch_matches_reference(page_size: int, radix: bool) -> None:
    s = make(page_size=page_size, radix=radix)
    ps = prompts(page_size, 12, shared=20)
    reqs = [submit(s, p, 10) for p in ps]
    s.run_until_idle()
    for p, r in zip(ps, reqs):
        assert r.output_ids == reference_generate(p, 10) and r.finish_reason == "length"
    assert s.stats.max_running <= 8
    assert drained(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_kv_exhaustion_queues_and_retracts(page_size: int) -> None:
    # 16 requests of up to ~70 tokens each in a 160-slot pool; admission reserves nothing (ratio 0)
    s = make(num_slots=160, page_size=page_size, max_running=16, init_new_token_ratio=0.0,
             min_new_token_ratio=0.0)
    ps = prompts(7 + page_size, 16, lo=10, hi=40)
    reqs = [submit(s, p, 30) for p in ps]
    s.run_until_idle()
    for p, r in zip(ps, reqs):
        assert r.output_ids == reference_generate(p, 30), r.rid
    assert s.stats.retractions > 0
    assert any(r.num_retractions for r in reqs)
    assert drained(s)


def test_request_larger_than_pool_ends_without_hurting_others() -> None:
    s = make(num_slots=64, page_size=4)
    big = submit(s, list(range(1, 50)), 40)  # 49 + 40 tokens cannot fit in 64 slots
    small = submit(s, [5, 6, 7], 5)
    s.run_until_idle()
    assert big.finish_reason == "length" and big.error and "KV pool" in big.error
    assert big.output_ids == reference_generate(list(range(1, 50)), len(big.output_ids))
    assert small.output_ids == reference_generate([5, 6, 7], 5)
    too_long = submit(s, list(range(100)), 3)
    s.run_until_idle()
    assert too_long.finish_reason == "abort" and "prompt has 100 tokens" in (too_long.error or "")
    assert drained(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_splits_long_prompts(page_size: int) -> None:
    s = make(page_size=page_size, chunk=8)
    ps = prompts(3, 4, lo=20, hi=45)
    reqs = [submit(s, p, 6) for p in ps]
    s.run_until_idle()
    for p, r in zip(ps, reqs):
        assert r.output_ids == reference_generate(p, 6)
    assert s.stats.chunked_steps >= 4
    assert s.stats.max_batch_tokens <= 8 + 8  # one chunk budget, plus decodes only in mixed mode
    assert drained(s)


def test_mixed_steps_run_decodes_alongside_prefill() -> None:
    s = make(chunk=8, mixed=True)
    s.record_modes = True
    first = submit(s, [1, 2, 3], 20)
    s.step()
    s.step()  # first is decoding now
    later = [submit(s, p, 5) for p in prompts(4, 3, lo=12, hi=30)]
    s.run_until_idle()
    assert first.output_ids == reference_generate([1, 2, 3], 20)
    for r in later:
        assert r.output_ids == reference_generate(r.input_ids, 5)
    assert s.stats.mixed_steps > 0 and "mixed" in s.stats.modes
    assert drained(s)


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_cache_hit_reuses_full_pages(page_size: int) -> None:
    s = make(page_size=page_size)
    shared = list(range(10, 40))  # 30 tokens
    a = submit(s, shared + [1, 2], 4)
    s.run_until_idle()
    b = submit(s, shared + [3, 4, 5], 4)
    s.run_until_idle()
    assert a.cached_tokens == 0
    assert b.cached_tokens == 30 - 30 % page_size
    assert b.output_ids == reference_generate(shared + [3, 4, 5], 4)
    assert drained(s)


def test_stop_conditions() -> None:
    s = make()
    out = reference_generate([1, 2, 3], 10)
    eos = Request("eos", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0), eos_token_ids=[out[3]])
    stop_id = Request("sid", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[out[5]]))
    ignore = Request("ign", [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True),
                     eos_token_ids=[out[3]])
    for r in (eos, stop_id, ignore):
        s.submit(r)
    s.run_until_idle()
    assert (eos.output_ids, eos.finish_reason, eos.matched_stop) == (out[:4], "stop", out[3])
    assert (stop_id.output_ids, stop_id.matched_stop) == (out[:6], out[5])
    assert (ignore.output_ids, ignore.finish_reason) == (out, "length")


class Letters:
    """A text decoder mapping token t to one letter."""

    def push(self, token_id: int) -> str:
        return chr(ord("a") + token_id % 26)


def test_stop_strings_trim_and_stream_never_leaks_them() -> None:
    s = make()
    out = reference_generate([1, 2, 3], 12)
    text = "".join(chr(ord("a") + t % 26) for t in out)
    stop = text[5:8]
    chunks: list[OutputChunk] = []
    req = Request("s", [1, 2, 3], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]),
                  decoder=Letters(), on_output=chunks.append, stream=True)
    s.submit(req)
    s.run_until_idle()
    cut = text.find(stop)
    assert req.text == text[:cut] and req.finish_reason == "stop" and req.matched_stop == stop
    assert "".join(c.text for c in chunks) == text[:cut]
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def test_abort_and_threaded_loop() -> None:
    s = make()
    done = threading.Event()
    results: dict[str, OutputChunk] = {}

    def collect(chunk: OutputChunk) -> None:
        if chunk.finished:
            results[chunk.rid] = chunk
            if len(results) == 3:
                done.set()

    s.start()
    try:
        for i in range(2):
            s.submit(Request(f"ok{i}", [i + 1, 2], SamplingParams(max_new_tokens=5, temperature=0),
                             on_output=collect))
        s.submit(Request("long", [9, 9], SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True),
                         on_output=collect))
        s.abort("long")
        assert done.wait(30)
    finally:
        s.stop()
    assert results["long"].finish_reason == "abort"
    assert results["ok0"].token_ids == reference_generate([1, 2], 5)
    assert drained(s)


@pytest.mark.parametrize("fail_at", [1, 2])  # the first (prefill) or second (decode) step
def test_a_failing_step_fails_its_requests_not_the_loop(fail_at: int) -> None:
    s = make(page_size=4)

    class Boom(HashModel):
        calls = 0

        def forward(self, batch: ForwardBatch) -> torch.Tensor:
            Boom.calls += 1
            if Boom.calls == fail_at:
                raise ValueError("kernel exploded")
            return super().forward(batch)

    s.runner = Boom()
    finished: list[OutputChunk] = []
    s.start()
    try:
        s.submit(Request("a", [1, 2], SamplingParams(max_new_tokens=5, temperature=0), on_output=finished.append))
        for _ in range(100):
            if finished:
                break
            threading.Event().wait(0.05)
        s.submit(Request("b", [1, 2], SamplingParams(max_new_tokens=3, temperature=0), on_output=finished.append))
        for _ in range(100):
            if len(finished) == 2:
                break
            threading.Event().wait(0.05)
    finally:
        s.stop()
    assert finished[0].finish_reason == "abort" and "kernel exploded" in (finished[0].error or "")
    assert finished[1].token_ids == reference_generate([1, 2], 3)
    assert drained(s)


def test_abort_between_prefill_chunks_frees_everything() -> None:
    s = make(chunk=8, page_size=4)
    req = submit(s, list(range(1, 41)), 5, rid="chunky")
    other = submit(s, [3, 4, 5], 5)
    s.step()
    assert s.chunked_req is req
    s.abort("chunky")
    s.run_until_idle()
    assert req.finish_reason == "abort" and req.output_ids == []
    assert other.output_ids == reference_generate([3, 4, 5], 5)
    assert drained(s)


def test_fill_slice_spans_prompt_and_output() -> None:
    req = Request("x", [1, 2, 3], SamplingParams())
    req.output_ids = [4, 5]
    for a in range(6):
        for b in range(a, 6):
            assert req.fill_slice(a, b) == req.fill_ids[a:b]


def test_a_broken_output_callback_aborts_only_its_request() -> None:
    s = make()

    def broken(chunk: OutputChunk) -> None:
        raise RuntimeError("event loop is closed")

    bad = Request("bad", [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0), on_output=broken, stream=True)
    good = submit(s, [4, 5, 6], 8)
    s.submit(bad)
    s.run_until_idle()
    assert bad.finish_reason == "abort" and good.output_ids == reference_generate([4, 5, 6], 8)
    assert drained(s)
