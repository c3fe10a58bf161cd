"""The L2 weight prefetch on a real sm_90+ GPU: it changes no value, and captured decode graphs really issue it.

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_l2_prefetch_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a CUDA GPU with sm_90+ (bulk L2 prefetch)"),
]


@pytest.mark.parametrize("numel,max_bytes", [(4096 * 4096, None), (1000 * 37 + 3, None), (4096 * 4096, 3 * 2**20 + 5)])
def test_prefetch_changes_no_value_eager_and_captured(numel: int, max_bytes: int | None) -> None:
    from sglx.llm.kernels.l2_prefetch import prefetch_l2

    w = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    x = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    prefetch_l2(w, max_bytes)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch_l2(w, max_bytes)
        y = w[:64] * x
        main.wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    assert torch.equal(y, before[:64] * x)


def _generate(path, monkeypatch, enabled: str) -> tuple[list[dict], int]:
    from sglx.llm.engine import Engine

    monkeypatch.setenv("SGLX_L2_PREFETCH", enabled)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (7, 33, 12)]
    params = [{"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}] * 3
    with Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                max_total_tokens=2048, cuda_graph_max_bs=4) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        streams = len(eng.runner.model.model.prefetch._streams)
        assert eng.runner.graph_runner is not None and eng.runner.graph_runner.replays > 0
    return out, streams


def test_decode_graphs_issue_the_prefetch_and_answer_as_without(tmp_path, monkeypatch) -> None:
    from llm_test_utils import make_tiny_model

    path = make_tiny_model(tmp_path, "llama", head_dim=64)
    with_prefetch, streams_on = _generate(path, monkeypatch, "1")
    without, streams_off = _generate(path, monkeypatch, "0")
    assert streams_on == 1 and streams_off == 0  # captured graphs forked the side stream only when on
    for a, b in zip(with_prefetch, without):
        assert a["output_ids"] == b["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"]  # same kernels on the main stream: bitwise equal
