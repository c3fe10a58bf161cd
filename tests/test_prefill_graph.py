"""Prefill CUDA graphs without a GPU: buckets, the on/off decision and why, the padded static inputs.

The static-buffer step itself (padding, the triton backend's in-graph indices, the model) runs under
the Triton interpreter in a child pytest (triton_interpreted/prefill_graph_cases.py) against Hugging
Face and the eager path; capturing and replaying real graphs is tested in tests/gpu/test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
from sglx.llm.prefill_graph_runner import (
    DEFAULT_MAX_PREFILL_TOKENS,
    PrefillInputBuffers,
    prefill_buckets,
    prefill_graph_plan,
)


def test_buckets_end_at_the_limit_and_pad_by_at_most_half():
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(20) == [16, 20]
    full = prefill_buckets(DEFAULT_MAX_PREFILL_TOKENS)
    assert full[0] == 16 and full[-1] == DEFAULT_MAX_PREFILL_TOKENS and full == sorted(set(full))
    for n in range(17, DEFAULT_MAX_PREFILL_TOKENS + 1):
        bucket = next(b for b in full if b >= n)
        assert bucket - n < n  # padding never exceeds the real tokens
        if n > 256:
            assert bucket - n < 0.34 * n
    with pytest.raises(ValueError):
        prefill_buckets(0)


def test_plan_follows_the_decode_graphs_and_says_why_not():
    on = prefill_graph_plan(True, "", "triton", True, None, 4096, 1)
    assert on.enabled and on.max_tokens == DEFAULT_MAX_PREFILL_TOKENS and on.buckets[-1] == on.max_tokens
    assert "1024 tokens" in on.describe()
    short = prefill_graph_plan(True, "", "triton", True, None, 300, 1)
    assert short.max_tokens == 300 and short.buckets[-1] == 300  # never longer than the context
    cases = {
        "--cuda-graph-max-prefill-tokens 0": prefill_graph_plan(True, "", "triton", True, 0, 4096, 1),
        "the device is cpu": prefill_graph_plan(False, "the device is cpu", "triton", True, None, 4096, 1),
        "flashinfer has no prefill graph support": prefill_graph_plan(True, "", "flashinfer", False, None, 4096, 1),
        "MLA prefill attention backend flashinfer has no prefill graph support (triton MLA has it":
            prefill_graph_plan(True, "", "flashinfer", False, None, 4096, 1, mla=True),
        "tensor parallelism": prefill_graph_plan(True, "", "triton", True, None, 4096, 2),
    }
    for why, plan in cases.items():
        assert not plan.enabled and why in plan.why and "off:" in plan.describe(), (why, plan)
    mla_on = prefill_graph_plan(True, "", "triton", True, None, 4096, 1, mla=True)
    assert mla_on.enabled and "on a cached prefix of at most 1024 tokens" in mla_on.why


def _pools() -> tuple[ReqToTokenPool, TokenKVPool]:
    return ReqToTokenPool(4, 64), TokenKVPool(128, 1, 1, 1, 8, torch.float32, "auto", "cpu")


def test_fill_pads_with_a_request_on_the_padding_row_that_writes_only_slot_0():
    r2t, pool = _pools()
    buffers = PrefillInputBuffers(32, torch.device("cpu"))
    buffers.out_cache_loc.fill_(99)  # a previous step's slots: padding must not keep them
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.tensor([7, 8, 9]), positions=torch.tensor([4, 5, 6]),
        req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([7]), out_cache_loc=torch.tensor([40, 41, 42]),
        req_to_token_pool=r2t, token_kv_pool=pool, extend_seq_lens_cpu=[3])
    buffers.fill(batch, 16)
    assert buffers.input_ids[:3].tolist() == [7, 8, 9] and buffers.positions[:3].tolist() == [4, 5, 6]
    assert buffers.out_cache_loc[:3].tolist() == [40, 41, 42]
    assert buffers.out_cache_loc[3:16].eq(0).all()  # padding: slot 0 of the padding page
    assert buffers.out_cache_loc[16:].eq(99).all()  # beyond the bucket: untouched, never read
    assert buffers.req_pool_indices.tolist() == [2, 0] and buffers.seq_lens.tolist() == [7, 13]
    assert buffers.qo_indptr64.tolist() == [0, 3, 16] and buffers.last_index.tolist() == [2]
    with pytest.raises(ValueError):
        buffers.fill(batch, 2)  # a bucket smaller than the prompt


def test_engine_flag_validates_cuda_graph_max_prefill_tokens():
    from sglx.errors import SglxError
    from sglx.llm.engine_config import EngineConfig

    assert EngineConfig(cuda_graph_max_prefill_tokens=0).cuda_graph_max_prefill_tokens == 0
    with pytest.raises(SglxError, match="--cuda-graph-max-prefill-tokens -1"):
        EngineConfig(cuda_graph_max_prefill_tokens=-1)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_prefill_graph_step_under_the_interpreter():
    from triton_interpreted.launch import run_interpreted

    run_interpreted("prefill_graph_cases.py")
