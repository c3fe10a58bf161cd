"""TritonBackend vs TorchNativeBackend (and float64) on the same ForwardBatches, under TRITON_INTERPRET=1.

tests/test_triton_backend.py launches this module in a child pytest. Each case replays one
request mix through extend (with cached prefixes), mixed and decode steps on two identical pools,
so stored K/V bits and every output are compared, fp8 pools included.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_triton_backend.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx import platform  # noqa: E402
from sglx.attention.checks import run_check  # noqa: E402
from sglx.attention.llm.base import BackendContext, LayerSpec  # noqa: E402
from sglx.attention.llm.torch_native import TorchNativeBackend  # noqa: E402
from sglx.attention.llm.triton import TritonBackend  # noqa: E402
from sglx.attention.registry import find  # noqa: E402
from sglx.errors import BackendUnavailableError  # noqa: E402
from sglx.llm.forward_batch import ForwardMode  # noqa: E402
from triton_interpreted.paged import PagedCache, make_paged_cache, reference_attention, step_batch  # noqa: E402

HQ, HKV, DIM = 4, 2, 64
PREFIX = [0, 13, 37]
STEPS = [(ForwardMode.EXTEND, [21, 6, 1]), (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.MIXED, [1, 4, 1]),
         (ForwardMode.DECODE, [1, 1, 1])]


def _backend(cls, cache: PagedCache, page: int):
    ctx = BackendContext(torch.device("cpu"), torch.float32, HQ, HKV, DIM, page, cache.r2t, cache.pool)
    return cls(ctx)


CASES = [
    # (page, kv_cache_dtype, scales, window, cap)
    (1, "auto", (1.0, 1.0), None, 0.0),
    (16, "auto", (1.0, 1.0), 9, 7.0),
    (16, "fp8_e4m3", (0.45, 1.6), None, 0.0),
    (1, "fp8_e5m2", (1.0, 1.0), 12, 0.0),
]


@pytest.mark.parametrize("page,kv_cache_dtype,scales,window,cap", CASES)
def test_triton_backend_equals_torch_native_step_by_step(page, kv_cache_dtype, scales, window, cap):
    total = [p + sum(s[1][i] for s in STEPS) for i, p in enumerate(PREFIX)]
    caches = [make_paged_cache(total, page, HKV, DIM, torch.float32, kv_cache_dtype=kv_cache_dtype, scales=scales,
                               fill=PREFIX, seed=page) for _ in range(2)]
    triton_be, native_be = _backend(TritonBackend, caches[0], page), _backend(TorchNativeBackend, caches[1], page)
    layer = LayerSpec(0, HQ, HKV, DIM, DIM ** -0.5, sliding_window=window, logit_cap=cap)
    gen = torch.Generator().manual_seed(3)
    lo = list(PREFIX)
    for mode, new in STEPS:
        q = torch.randn(sum(new), HQ, DIM, generator=gen)
        outs = []
        for cache, backend in zip(caches, (triton_be, native_be)):
            batch = step_batch(cache, mode, lo, new)
            k = torch.cat([kk[a:a + n] for kk, a, n in zip(cache.raw_keys, lo, new)])
            v = torch.cat([vv[a:a + n] for vv, a, n in zip(cache.raw_values, lo, new)])
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k, v, layer, batch))
        assert (outs[0] - outs[1]).abs().max().item() <= 2e-5, mode
        row = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            cache = caches[0]
            ref = reference_attention(q[row:row + n], cache.keys[i][:a + n], cache.values[i][:a + n],
                                      torch.arange(a, a + n), layer.scaling, window, cap)
            assert (outs[0][row:row + n].double() - ref).abs().max().item() <= 2e-5, (mode, i)
            row += n
        lo = [a + n for a, n in zip(lo, new)]
    for mine, theirs in ((caches[0].pool.k_buffer[0], caches[1].pool.k_buffer[0]),
                         (caches[0].pool.v_buffer[0], caches[1].pool.v_buffer[0])):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_doctor_check_passes_with_the_triton_backend():
    result = run_check(find("triton", "llm", "mha"), platform.fake("cpu"))
    assert result.status == "pass", result
    assert result.max_abs_error is not None and result.max_abs_error <= result.tolerance


def test_triton_on_cpu_without_the_interpreter_says_what_to_use(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    cache = make_paged_cache([4], 1, HKV, DIM, torch.float32)
    with pytest.raises(BackendUnavailableError, match="torch_native"):
        _backend(TritonBackend, cache, 1)
