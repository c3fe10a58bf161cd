"""`sglx bench offline-throughput` on a real GPU: the embedded model with CUDA graphs, counts equal to what was asked.

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_bench_offline_gpu.py -q
Not yet run on a device (written in session 5 without GPU time).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]


@pytest.mark.parametrize("max_concurrency", [None, 4])
def test_offline_bench_on_the_gpu_counts_what_was_asked(max_concurrency: int | None) -> None:
    from sglx.bench.offline_throughput import OfflineBenchConfig, offline_prompts, run_offline_throughput
    from sglx.llm.engine_config import EngineConfig

    cfg = OfflineBenchConfig(num_prompts=16, input_len=64, output_len=8, range_ratio=0.5,
                             max_concurrency=max_concurrency)
    report = run_offline_throughput(EngineConfig(device="cuda"), cfg)
    assert report["engine"]["device"].startswith("cuda") and report["environment"]["cuda_device"]
    assert report["completed"] == 16 and report["failed"] == 0
    prompts = offline_prompts(cfg, _vocab())
    assert report["total_output_tokens"] == sum(p.output_len for p in prompts)
    assert report["total_input_tokens"] == sum(len(p.prompt) for p in prompts)
    assert report["output_token_throughput"] > 0


def _vocab() -> int:
    """The embedded model's vocabulary (what the server would report), read from its config, not the engine."""
    import json

    from sglx.llm.embedded import default_model_path

    return int(json.loads((default_model_path() / "config.json").read_text())["vocab_size"])
