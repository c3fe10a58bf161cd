"""The `triton` LLM backend equals the reference backend step by step, on CPU through the Triton interpreter.

The cases (tests/triton_interpreted/backend_cases.py) run in a child pytest with TRITON_INTERPRET=1,
which must be set before the kernels are defined and must not leak into this process.
"""

from __future__ import annotations

import importlib.util

import pytest

from sglx.attention.registry import find
from triton_interpreted.launch import run_interpreted


def test_registry_declares_what_the_triton_backend_implements():
    spec = find("triton", "llm", "mha")
    assert spec is not None and spec.factory == "sglx.attention.llm.triton:TritonBackend"
    feats = spec.features
    assert feats.native_paging and feats.fp8_kv and feats.sliding_window and feats.cuda_graph
    assert not (feats.fp4_kv or feats.spec_topk1 or feats.spec_topk_gt1 or feats.multimodal)
    assert spec.load().supports_cuda_graph  # the declaration and the implementation agree


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_backend_matches_torch_native_under_the_interpreter():
    run_interpreted("backend_cases.py")
