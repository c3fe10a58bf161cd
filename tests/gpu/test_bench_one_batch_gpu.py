"""`sglx bench one-batch` prefill against its same-run compute floor on a real GPU (Llama-3.1-8B shape, dummy bf16).

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_bench_one_batch_gpu.py -q
Not yet run on a device (written in session 5 without GPU time).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]


def test_llama_8b_bs1_prefill_floor_is_measured_with_vendor_calls() -> None:
    from sglx.bench.one_batch import OneBatchConfig, run_one_batch
    from sglx.llm.engine_config import EngineConfig

    report = run_one_batch(EngineConfig(model_path="llama-3.1-8b", load_format="dummy", dtype="bfloat16",
                                        attention_backend="triton", device="cuda"),
                           OneBatchConfig(batch_sizes=(1,), input_len=512, output_len=4))
    [r] = report["results"]
    gemm_tflops = r["prefill_gemm_flops"] / (r["prefill_floor_gemm_ms"] * 1e-3) / 1e12
    assert 100 < gemm_tflops < 1000, r  # cuBLAS bf16 on an H100/H200: a few hundred TFLOP/s, never above peak
    [att] = r["prefill_floor_attention"]
    assert att["call"] in ("sdpa cudnn", "sdpa flash", "sdpa efficient") and att["count"] == 32, att
    # the device time of a prefill cannot beat its floor by more than timing noise, and never exceeds its wall time
    assert r["prefill_device_ms_median"] <= r["prefill_ms"] * 1.01, r
    assert r["prefill_device_ms_median"] >= 0.9 * r["prefill_floor_ms"], r
    assert r["prefill_device_ratio_to_floor"] == pytest.approx(r["prefill_device_ms_median"] / r["prefill_floor_ms"])
    assert r["prefills_before_timing"] == 1 and r["prefill_runs"] == 5
