"""CUDA-graph decode logic that needs no GPU: buckets, the on/off decision and why, padded inputs.

The triton backend's graph hooks run under the Triton interpreter in a child pytest
(triton_interpreted/graph_cases.py); replaying real graphs is tested on a GPU in tests/gpu.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglx.llm.cuda_graph_runner import (
    DEFAULT_MAX_BS,
    DecodeInputBuffers,
    bucket_for,
    capture_batch_sizes,
    cuda_graph_plan,
)
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it here


def test_buckets_are_powers_of_two_then_steps_of_eight_up_to_the_limit():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


@pytest.mark.parametrize("max_bs", [1, 5, 8, 30, 64, 160])
def test_every_batch_size_gets_the_smallest_bucket_that_holds_it(max_bs):
    buckets = capture_batch_sizes(max_bs)
    for bs in range(1, max_bs + 1):
        bucket = bucket_for(bs, buckets)
        assert bucket is not None and bucket >= bs
        assert all(b < bs for b in buckets if b < bucket)  # no smaller bucket would do
        assert bucket - bs < 8  # at most 7 padded slots
    assert bucket_for(max_bs + 1, buckets) is None and bucket_for(0, buckets) is None


def test_plan_says_why_graphs_are_off():
    on = cuda_graph_plan(CUDA, "triton", True, False, None, 4096)
    assert on.enabled and on.max_bs == DEFAULT_MAX_BS and on.batch_sizes[-1] == DEFAULT_MAX_BS
    capped = cuda_graph_plan(CUDA, "triton", True, False, 64, 20)
    assert capped.max_bs == 20 and capped.batch_sizes == (1, 2, 4, 8, 16, 20)
    off = cuda_graph_plan(CUDA, "torch_native", False, False, None, 64)
    assert not off.enabled and "torch_native does not support CUDA graphs" in off.why
    assert "off:" in off.describe()
    assert "--disable-cuda-graph" in cuda_graph_plan(CUDA, "triton", True, True, None, 64).why
    assert "cpu" in cuda_graph_plan(torch.device("cpu"), "triton", True, False, None, 64).why


def test_padding_fills_the_bucket_with_requests_that_touch_only_the_padding_page():
    buffers = DecodeInputBuffers(8, torch.device("cpu"))
    buffers.input_ids.fill_(-7)  # stale values from an earlier, larger step must be overwritten
    buffers.out_cache_loc.fill_(-7)
    r2t = ReqToTokenPool(4, 64)
    pool = TokenKVPool(64, 1, 1, 1, 16, torch.float32)
    batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.tensor([11, 12, 13]),
                         positions=torch.tensor([4, 9, 2]), req_pool_indices=torch.tensor([3, 1, 2]),
                         seq_lens=torch.tensor([5, 10, 3]), out_cache_loc=torch.tensor([40, 41, 42]),
                         req_to_token_pool=r2t, token_kv_pool=pool, seq_lens_cpu=[5, 10, 3])
    lens = buffers.fill(batch, 4, fill_seq_len=1)
    assert lens == [5, 10, 3, 1]
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 9, 2, 0]
    assert buffers.req_pool_indices[:4].tolist() == [3, 1, 2, 0]  # row 0: the padding row of req_to_token
    assert buffers.seq_lens[:4].tolist() == [5, 10, 3, 1]
    assert buffers.out_cache_loc[:4].tolist() == [40, 41, 42, 0]  # slot 0: the reserved padding page
    assert r2t.req_to_token[0].eq(0).all()  # so padding reads slot 0 too
    padded = buffers.batch(4, type("R", (), {"req_to_token_pool": r2t, "token_kv_pool": pool, "backend": None})(),
                           lens)
    assert padded.batch_size == 4 and padded.mode is ForwardMode.DECODE
    assert padded.input_ids.data_ptr() == buffers.input_ids.data_ptr()  # views: graph addresses stay fixed
    with pytest.raises(ValueError):
        buffers.fill(batch, 2, 1)


def test_cpu_engine_reports_graphs_off_and_why():
    from sglx.llm.engine import Engine

    with Engine(device="cpu", dtype="float32", max_total_tokens=512, attention_backend="torch_native") as eng:
        info = eng.info
        assert info["cuda_graph"] is False and "cpu" in info["cuda_graph_why"]
        assert eng.runner.graph_runner is None
        # short prefills replay graphs only where decode graphs run (llm/prefill_graph_runner.py)
        assert info["prefill_cuda_graph"] is False and "cpu" in info["prefill_cuda_graph_why"]
        assert eng.runner.prefill_graph_runner is None


def test_engine_flags_validate_cuda_graph_max_bs():
    from sglx.errors import SglxError
    from sglx.llm.engine_config import EngineConfig

    assert EngineConfig(cuda_graph_max_bs=8, disable_cuda_graph=True).cuda_graph_max_bs == 8
    with pytest.raises(SglxError, match="--cuda-graph-max-bs 0"):
        EngineConfig(cuda_graph_max_bs=0)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_graph_hooks_under_the_interpreter():
    from triton_interpreted.launch import run_interpreted

    run_interpreted("graph_cases.py")


def test_capture_buckets_prepares_largest_first_warms_twice_and_keeps_outputs(monkeypatch):
    """The capture loop both graph runners share, with CUDA's graph calls stood in (their order is the contract)."""
    import contextlib

    from sglx.llm import cuda_graph_runner as cgr

    calls: list[tuple] = []

    class FakeStream:
        def wait_stream(self, other):  # noqa: ANN001, ANN202
            calls.append(("wait",))

    class FakeGraph:
        pass

    @contextlib.contextmanager
    def capturing(graph, pool=None, stream=None):  # noqa: ANN001, ANN202
        calls.append(("capture-begin", pool))
        yield
        calls.append(("capture-end",))

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync",)))

    def step(bucket):  # noqa: ANN001, ANN202
        calls.append(("step", bucket))
        return torch.full((bucket,), float(bucket)), (torch.tensor([bucket]) if bucket > 1 else None)

    graphs, outputs, greedy = cgr.capture_buckets(CUDA, [1, 2, 4], lambda b: calls.append(("prepare", b)), step)
    assert set(graphs) == set(outputs) == {1, 2, 4} and set(greedy) == {2, 4}  # no pick made: none kept
    assert all(isinstance(g, FakeGraph) for g in graphs.values()) and outputs[4].tolist() == [4.0] * 4
    expected = [call for b in (4, 2, 1) for call in (
        ("prepare", b), ("wait",), ("step", b), ("step", b), ("wait",),  # two warm-ups on the capture stream
        ("capture-begin", "pool"), ("step", b), ("capture-end",))]  # then the captured step, one shared pool
    assert calls == [*expected, ("sync",)]
