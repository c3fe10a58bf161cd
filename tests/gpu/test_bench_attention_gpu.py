"""`sglx bench attention --cuda-graph` on a GPU: decode calls captured and replayed, still checked first.

The graph rows must give what the eager rows give: every sglx backend and baseline that runs here checks against
the float64 reference (a replay that read stale metadata or the wrong buffers would fail it) and is timed.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - the gpu marker is deselected on CPU runs
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("page", [1, 16])
def test_decode_rows_as_cuda_graph_replays_check_and_time(page: int) -> None:
    from sglx.bench.attention import AttentionBenchConfig, run_attention_bench
    from sglx.llm.kernels import use_fused  # noqa: F401 - triton must import for the triton backend

    config = AttentionBenchConfig(backends=("triton",), phases=("decode",), batch_size=3, context_lens=(700,),
                                  page_sizes=(page,), kv_cache_dtypes=("auto", "fp8_e4m3"), cuda_graph=True,
                                  warmup_ms=2, rep_ms=10)
    report = run_attention_bench(config)
    assert "CUDA graph" in report["timing"] and report["config"]["cuda_graph"] is True
    for case in report["cases"]:
        rows = {r["backend"]: r for r in case["rows"]}
        triton = rows["triton"]
        assert triton["ok"] and triton["median_ms"] > 0 and triton["detail"] == "CUDA graph replay", triton
        assert triton["metadata_ms"] > 0
        sdpa = next(r for r in case["rows"] if r["kind"] == "sdpa")
        assert sdpa["ok"] and "CUDA graph replay" in sdpa["detail"], sdpa
    assert not report["failed"]
