"""Overlap scheduling (sglx.llm.overlap): the same outputs as the step-by-step loop, with tokens read one step late.

On a CPU the device is synchronous, so overlap gains no time here, but its logic runs exactly as on a GPU:
step n+1 is scheduled and launched before the host reads step n's tokens (checked by a spy on the model),
decode inputs are placeholders resolved on the device through the future-token map, and requests that
step n finished ran one discarded extra step whose KV slot must come back. References: the hash model of
test_scheduler (every slot and position is read back), Hugging Face's greedy tokens for a tiny Llama, and
the same engine with `--disable-overlap-schedule`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
from sglx.llm.engine import Engine
from sglx.llm.overlap import FutureTokenMap
from sglx.llm.tokenizer import Tokenizer
from test_scheduler import VOCAB, HashModel, drained, make, prompts, reference_generate, submit

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ---------------------------------------------------------------- the future-token map


def test_future_map_resolves_placeholders_on_the_device_and_wraps() -> None:
    fm = FutureTokenMap(max_running_requests=2, device=torch.device("cpu"))  # 7 entries
    first = fm.reserve(3)
    fm.store(first, torch.tensor([70, 0, 9]))
    assert first == [1, 2, 3]
    ids = torch.tensor([5, -first[0], 0, -first[1], -first[2], 12])
    assert fm.resolve(ids).tolist() == [5, 70, 0, 0, 9, 12]  # token 0 is real, placeholder entries are >= 1
    second = fm.reserve(5)  # wraps: entries stay in 1..7
    assert second == [4, 5, 6, 7, 1]
    fm.store(second, torch.tensor([11, 12, 13, 14, 15]))
    assert fm.resolve(torch.tensor([-1, -2, -7])).tolist() == [15, 0, 14]


# ---------------------------------------------------------------- scheduler, hash model


class SpyModel(HashModel):
    """Records, per forward, whether a launched step's tokens were still unread (the overlap) and how many
    input ids were placeholders before the device resolved them."""

    def __init__(self) -> None:
        self.scheduler = None
        self.unread_at_launch: list[bool] = []
        self.placeholders = 0

    def forward(self, batch):  # noqa: ANN001, ANN201
        s = self.scheduler
        self.unread_at_launch.append(s._pending is not None)
        table = s.req_to_token_pool.req_to_token
        for r in s.running:  # the host copy of each row (read by the prefix cache) is the device table's
            known = r.host_slots(r.kv_len)
            assert known is not None and torch.equal(known, table[r.row, :r.kv_len].long()), r.rid
        return super().forward(batch)


def spied(**kw):  # noqa: ANN003, ANN201
    s = make(**kw)
    spy = SpyModel()
    spy.scheduler = s
    s.runner = spy
    if s.future_map is not None:
        resolve = s.future_map.resolve

        def counting(ids: torch.Tensor) -> torch.Tensor:
            spy.placeholders += int((ids < 0).sum())
            return resolve(ids)

        s.future_map.resolve = counting
    return s, spy


WORKLOADS = {
    "plain": dict(),
    "pages4_chunked": dict(page_size=4, chunk=8),
    "mixed": dict(chunk=8, mixed=True),
    "no_radix": dict(page_size=16, radix=False),
    "tight_pool": dict(num_slots=64, page_size=4, max_running=16, init_new_token_ratio=0.0,
                       min_new_token_ratio=0.0),
}


def _run_workload(overlap: bool, kw: dict, seed: int) -> tuple[list, object, SpyModel]:
    s, spy = spied(enable_overlap=overlap, **kw)
    rng = random.Random(seed)
    reqs = []
    for i, p in enumerate(prompts(seed, 14, lo=3, hi=30, shared=12)):
        n = rng.choice([1, 1, 2, 5, 17, 30])  # max_tokens=1 finishes right after prefill
        stop = rng.sample(range(VOCAB), 6) if i % 3 == 0 else ()
        reqs.append(submit(s, p, n, rid=f"r{i}", stop_token_ids=stop))
        if i % 5 == 4:  # requests also arrive while others decode
            for _ in range(3):
                s.step()
    s.run_until_idle()
    outs = [(r.rid, r.output_ids, r.finish_reason, r.matched_stop, r.cached_tokens) for r in reqs]
    for r, p in zip(reqs, prompts(seed, 14, lo=3, hi=30, shared=12)):
        ref = reference_generate(p, len(r.output_ids))
        assert r.output_ids == ref, r.rid
    assert drained(s), "every KV page and request row (the extra step's slot included) comes back"
    return outs, s, spy


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_scheduler_outputs_identical_with_and_without_overlap(name: str) -> None:
    kw = WORKLOADS[name]
    on, s_on, spy_on = _run_workload(True, kw, seed=5)
    off, s_off, spy_off = _run_workload(False, kw, seed=5)
    assert on == off
    assert any(r[2] == "stop" for r in on) and any(len(r[1]) == 1 for r in on)
    # the overlap really happened: steps launched with the previous step unread, inputs fed by placeholders
    assert sum(spy_on.unread_at_launch) > len(spy_on.unread_at_launch) // 2
    assert spy_on.placeholders > 0
    assert not any(spy_off.unread_at_launch) and s_off.future_map is None
    assert s_on.stats.generated_tokens == s_off.stats.generated_tokens == sum(len(r[1]) for r in on)
    if name == "tight_pool":
        assert s_on.stats.retractions > 0 and s_off.stats.retractions > 0


def test_finished_request_is_read_one_step_late_and_its_extra_slot_freed() -> None:
    s, spy = spied(page_size=1)
    req = submit(s, [3, 4, 5], 2)
    s.step()  # prefill launched; token 1 unread
    assert req.output_ids == [] and req.pending_tokens == 1
    s.step()  # decode launched with a placeholder input, then token 1 read
    assert req.output_ids == reference_generate([3, 4, 5], 1) and not req.finished
    assert spy.placeholders == 1
    s.step()  # a third (extra) step is launched before token 2 is read: it finishes the request
    assert req.finished and req.output_ids == reference_generate([3, 4, 5], 2)
    assert s.stats.steps == 3 and s.running == []
    s.run_until_idle()
    assert drained(s)


def test_abort_while_a_step_is_in_flight() -> None:
    s, _ = spied()
    keep = submit(s, [1, 2, 3], 12, rid="keep")
    gone = submit(s, [7, 8, 9], 50, rid="gone")
    for _ in range(4):
        s.step()
    assert s._pending is not None and gone.pending_tokens == 1
    s.abort("gone")
    s.run_until_idle()
    assert gone.finish_reason == "abort" and gone.output_ids == reference_generate([7, 8, 9], len(gone.output_ids))
    assert keep.output_ids == reference_generate([1, 2, 3], 12)
    assert drained(s)


def test_penalties_read_tokens_before_the_next_step() -> None:
    """Penalties need every output id on the host: such steps wait for the step in flight, outputs unchanged."""
    outs = []
    for overlap in (True, False):
        s, spy = spied(enable_overlap=overlap)
        reqs = [submit(s, p, 12, rid=str(i), repetition_penalty=1.3) for i, p in enumerate(prompts(2, 4))]
        s.run_until_idle()
        outs.append([r.output_ids for r in reqs])
        assert drained(s)
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- engine, tiny Llama vs Hugging Face

STEPS = 16
TEXTS = ["The quick brown fox", "Attention reads keys and values through a table that maps positions to slots.",
         "Radix trees share the prefix of prompts"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = make_tiny_model(tmp_path_factory.mktemp("overlap_models"), "llama")
    tok = Tokenizer.from_dir(path)
    ids = [tok.encode(t) for t in TEXTS]
    hf = load_hf_model(path)
    return path, ids, [hf_greedy(hf, p, STEPS)[0] for p in ids]


def _engine_outputs(path: Path, overlap: bool, ids: list[list[int]], **flags) -> dict:
    greedy = {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=str(path), dtype="float32", max_total_tokens=2048, page_size=16,
                disable_overlap_schedule=not overlap, **flags) as eng:
        initial = eng.free_kv_slots()
        assert eng.info["overlap_schedule"] is overlap and (eng.scheduler.future_map is not None) is overlap
        out: dict = {"greedy": eng.generate(input_ids=ids, sampling_params=greedy, return_logprob=True)}
        # a radix-cache hit: the same prompts again
        out["again"] = eng.generate(input_ids=ids, sampling_params=greedy)
        out["one"] = eng.generate(input_ids=ids, sampling_params={**greedy, "max_new_tokens": 1})
        ref0 = out["greedy"][0]["output_ids"]
        out["stop_id"] = eng.generate(input_ids=ids[0], sampling_params={**greedy, "stop_token_ids": [ref0[5]]})
        full = eng.generate(TEXTS[1], greedy)["text"]
        stop = full[len(full) // 2: len(full) // 2 + 3]
        out["stop_str"] = eng.generate(TEXTS[1], {**greedy, "stop": [stop]})
        seeded = {"max_new_tokens": STEPS, "temperature": 0.9, "top_p": 0.95, "seed": 7, "ignore_eos": True}
        out["seeded"] = eng.generate(input_ids=ids, sampling_params=[seeded, {**seeded, "seed": 8}, seeded])

        async def stream_then_leave() -> list[dict]:
            chunks = []
            async for chunk in eng.generate_stream(input_ids=ids[2], sampling_params={**greedy, "max_new_tokens": 64}):
                chunks.append(chunk)
                if len(chunks) == 3:
                    break  # leaving the stream aborts the request in the engine
            return chunks

        out["aborted_prefix"] = [t for c in asyncio.run(stream_then_leave()) for t in c["output_ids"]]
        out["after_abort"] = eng.generate(input_ids=ids, sampling_params=greedy)
        assert eng.flush_cache() == initial, "every KV slot comes back (the extra steps' too)"
        out["steps"] = eng.scheduler.stats.steps
    return out


def _public(results: list[dict] | dict) -> list:
    keep = ("output_ids", "text", "finish_reason", "matched_stop", "cached_tokens", "output_logprobs")
    items = results if isinstance(results, list) else [results]
    return [{k: r.get(k) for k in keep} for r in items]


def test_engine_identical_with_and_without_overlap_and_equal_to_hf(llama) -> None:  # noqa: ANN001
    path, ids, refs = llama
    on = _engine_outputs(path, True, ids, chunked_prefill_size=16)
    off = _engine_outputs(path, False, ids, chunked_prefill_size=16)
    assert [r["output_ids"] for r in on["greedy"]] == refs
    assert [r["output_ids"] for r in on["one"]] == [r[:1] for r in refs]
    assert any(r["cached_tokens"] > 0 for r in on["again"])  # a prefix-cache hit (whole 16-token pages)
    stop_at = refs[0].index(refs[0][5]) + 1  # the first time the stop token comes
    assert on["stop_id"]["finish_reason"] == "stop" and on["stop_id"]["output_ids"] == refs[0][:stop_at]
    assert on["stop_str"]["finish_reason"] == "stop"
    assert on["aborted_prefix"] == refs[2][:len(on["aborted_prefix"])] and on["aborted_prefix"]
    for key in ("greedy", "again", "one", "stop_id", "stop_str", "seeded", "after_abort"):
        assert _public(on[key]) == _public(off[key]), key
    for a, b in zip(on["greedy"], off["greedy"]):  # logprobs read one step late are the same numbers
        torch.testing.assert_close(torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]),
                                   atol=1e-6, rtol=0)
    assert on["steps"] > off["steps"]  # finished requests ran one discarded extra step


def _embedded_dir() -> Path | None:
    from sglx.llm.embedded import default_model_path

    path = default_model_path()
    return path if (path / "model.safetensors").is_file() else None


@pytest.mark.skipif(_embedded_dir() is None, reason="the embedded model is not built yet")
def test_embedded_model_identical_with_and_without_overlap() -> None:
    from sglx.llm.embedded.task import MAX_PAIRS, make_example

    rng = random.Random(13)
    examples = [make_example(rng, MAX_PAIRS // 2) for _ in range(4)]
    params = [{"max_new_tokens": n, "temperature": 0.0} for n in (8, 1, 8, 3)]
    outs = []
    for overlap in (True, False):
        with Engine(dtype="float32", chunked_prefill_size=64, disable_overlap_schedule=not overlap) as eng:
            first = eng.generate([p for p, _ in examples], params)
            again = eng.generate([p for p, _ in examples[:2]], params[:2])  # prefix-cache hits
            outs.append([(r["text"], r["output_ids"], r["finish_reason"]) for r in first + again])
    assert outs[0] == outs[1]
    assert sum(answer in text for (text, _, _), (_, answer) in zip(outs[0], examples + examples[:2])) >= 2


def test_cli_flag_turns_overlap_off(llama) -> None:  # noqa: ANN001
    path, ids, refs = llama
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "sglx", "generate", "--model-path", str(path), "--prompt", TEXTS[0],
                           "--max-new-tokens", str(STEPS), "--ignore-eos", "--json", "--dtype", "float32",
                           "--disable-overlap-schedule"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["output_ids"] == refs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{"attention_backend": "triton"},  # decode steps replay CUDA graphs
                                   {"attention_backend": "triton", "disable_cuda_graph": True}])
def test_cuda_identical_with_and_without_overlap(llama, flags: dict) -> None:  # noqa: ANN001
    """On the GPU the host really runs ahead: the same outputs, the graph's in-graph argmax feeding the future map."""
    path, ids, refs = llama
    on = _engine_outputs(path, True, ids, device="cuda", **flags)
    off = _engine_outputs(path, False, ids, device="cuda", **flags)
    assert [r["output_ids"] for r in on["greedy"]] == refs
    for key in ("greedy", "again", "one", "stop_id", "stop_str", "seeded", "after_abort"):
        assert [r["output_ids"] for r in _public(on[key])] == [r["output_ids"] for r in _public(off[key])], key
        assert [r["finish_reason"] for r in _public(on[key])] == [r["finish_reason"] for r in _public(off[key])], key
