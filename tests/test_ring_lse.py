"""Ring attention runs each step on the selected backend's LSE path (registry feature `lse`), merges exactly,
and says so where it falls back (sage_attn) or refuses (sparse backends, tested in test_sequence_parallel.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from ring_lse_workers import Calls, exact_with_lse, fa2_standin, fa4_standin, ring_backend_cases
from sglx.attention.diffusion.base import DiffusionAttentionBackend
from sglx.attention.diffusion.flash_attn import FlashAttentionBackend, lse_keywords
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.attention.registry import DiffusionFeatures, all_backends
from sglx.diffusion.parallel.lse_attention import LSEMerger
from sglx.distributed.spawn import spawn_workers
from sglx.errors import SglxError

NAMES = ["torch_sdpa", "fa4", "fa2", "sage"]


@pytest.fixture(scope="module")
def ring2() -> dict[str, dict]:
    return spawn_workers(ring_backend_cases, 2, (NAMES,), timeout_s=180)[0]


def test_ring2_on_the_backends_lse_path_equals_sp1(ring2: dict[str, dict]) -> None:
    """Ring 2 (prefix text, GQA): every ring step of torch_sdpa and fa (FA4- and FA2-style kernels) is a call of
    the backend's own kernel asking for the LSE (2 per rank: own block + the neighbour's), and the merged result
    equals SP 1 through the same backend and float64 attention."""
    tol = {"torch_sdpa": 2e-5, "fa4": 1.6e-2, "fa2": 1.6e-2}  # float32; bf16 partial outputs merged in float32
    for name, t in tol.items():
        r = ring2[name]
        assert r["own_kernel"] is True and r["warnings"] == [], (name, r)
        assert r["kernel_calls"] == 2 and r["lse_requests"] == 2, (name, r)
        assert r["vs_sp1"] < t and r["vs_f64"] < t, (name, r)
        assert r["text_spread"] == 0.0


def test_ring2_without_an_lse_kernel_falls_back_visibly(ring2: dict[str, dict]) -> None:
    """sage_attn's kernel returns no LSE: the ring steps run on PyTorch SDPA's LSE kernels (the kernel is not
    called at all for self-attention), the result is still exact, and a warning names the fallback."""
    r = ring2["sage"]
    assert r["own_kernel"] is False and r["kernel_calls"] == 0, r
    assert r["vs_f64"] < 1.6e-2, r
    assert len(r["warnings"]) == 1 and "NOT sage_attn" in r["warnings"][0], r


def test_lse_merge_is_exact_in_float64() -> None:
    """Three unequal key blocks through torch_sdpa's LSE path in float64, merged: the full softmax to 1e-12."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=gen, dtype=torch.float64) * 3  # wide score range
    k = torch.randn(2, 23, 2, 16, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(2, 23, 2, 16, generator=gen, dtype=torch.float64)
    backend, merger = TorchSDPABackend(), LSEMerger()
    for lo, hi in ((0, 5), (5, 6), (6, 23)):
        out, lse = backend.forward_dense_with_lse(q, k[:, lo:hi], v[:, lo:hi], scale=0.3)
        assert out.dtype == torch.float64 and lse.dtype == torch.float64 and lse.shape == (2, 4, 7)
        merger.add(out, lse)
    rep_k, rep_v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, rep_k) * 0.3
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), rep_v)
    assert merger.lse is not None
    torch.testing.assert_close(merger.lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=0)
    torch.testing.assert_close(merger.result(torch.float64), want, atol=1e-12, rtol=0)


def test_fa_lse_keywords_and_padded_lse() -> None:
    q, k, v = (torch.randn(1, 9, 2, 16, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2, 3))
    want_out, want_lse = exact_with_lse(q, k, v, None)
    for make, kw in ((fa4_standin, {"return_lse": True}), (fa2_standin, {"return_attn_probs": True})):
        calls = Calls()
        fn = make(calls)
        assert lse_keywords(fn) == kw
        out, lse = FlashAttentionBackend(kernel=fn, variant="FA").forward_dense_with_lse(q, k, v)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and calls.lse_requests == 1
    assert lse_keywords(torch.exp) == {}  # a builtin without a Python signature: called plainly


def test_fa_build_without_lse_is_one_line() -> None:
    def out_only(q, k, v, softmax_scale=None, causal=False):  # type: ignore[no-untyped-def]
        return exact_with_lse(q, k, v, softmax_scale)[0]

    q = torch.randn(1, 9, 2, 16).bfloat16()
    with pytest.raises(SglxError, match=r"returned no log-sum-exp of shape \[1, 2, 9\].*--ring-degree 1") as info:
        FlashAttentionBackend(kernel=out_only, variant="FA2").forward_dense_with_lse(q, q, q)
    assert "\n" not in str(info.value)


def _overrides_lse(cls: type) -> bool:
    return cls.forward_dense_with_lse is not DiffusionAttentionBackend.forward_dense_with_lse


def test_registry_lse_feature_matches_the_backend_classes() -> None:
    """A dense backend declares `lse=True` in the registry exactly when its class implements
    forward_dense_with_lse; sparse backends never declare it (ring refuses them)."""
    seen = 0
    for spec in all_backends("diffusion"):
        assert isinstance(spec.features, DiffusionFeatures)
        if not spec.implemented:
            continue
        module, _, name = str(spec.factory).partition(":")
        cls = getattr(importlib.import_module(module), name)
        if spec.features.sparse:  # their dense fallback may inherit torch_sdpa's LSE path; ring refuses them
            assert not spec.features.lse, spec.name
        else:
            assert _overrides_lse(cls) == spec.features.lse, spec.name
        seen += 1
    assert seen >= 6


def test_doctor_rows_say_what_ring_does() -> None:
    from sglx.doctor import build_report
    from sglx.platform import fake

    report = build_report(fake("cpu"), family="diffusion")
    rows = {r["name"]: r for s in report["sections"] for r in s["backends"]}
    assert rows["torch_sdpa"]["ring_attention"].startswith("Y")
    assert rows["sage_attn"]["ring_attention"].startswith("fallback: ring steps on PyTorch SDPA")
    assert rows["video_sparse_attn"]["ring_attention"].startswith("N: refused")
