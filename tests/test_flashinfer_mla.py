"""The flashinfer MLA backend's wrapper logic on CPU, with a stand-in of `flashinfer.mla.BatchMLAPagedAttentionWrapper`.

FlashInfer runs only on the lent GPU (tests/gpu/test_mla_gpu.py and `doctor --check` judge the real kernel there).
Here a float64 stand-in with the wrapper's documented contract (plan with CSR page indices, per-request kv
lengths, causal queries aligned with the END of their keys; run on ckv [pages, page_size, 512-ish] and kpe
views) checks what sglx hands it: indices, lengths, heads, dims, scale, causal flag, the pool views, absorption.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
from sglx.attention.llm.paged_latents import PagedLatents
from sglx.llm.forward_batch import ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.mla_kv_cache import MLATokenKVPool

H, DN, DR, DV, R = 4, 16, 8, 12, 32
SPEC = MLALayerSpec(2, H, DN, DR, DV, R, 0.6 * (DN + DR) ** -0.5)
pytestmark = pytest.mark.usefixtures("single_torch_thread")


class StandInMLAWrapper:
    """flashinfer.mla.BatchMLAPagedAttentionWrapper's documented behaviour, in float64."""

    plans: list[dict] = []

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False, **_: object) -> None:
        assert float_workspace_buffer.numel() >= 1 << 20 and not use_cuda_graph

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,  # noqa: ANN001
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False) -> None:
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        self.p = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), pages=kv_indices, lens=kv_len_arr.tolist(),
                      heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page=page_size, causal=causal,
                      scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type)
        StandInMLAWrapper.plans.append(self.p)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False) -> torch.Tensor:  # noqa: ANN001
        p = self.p
        assert q_nope.shape == (p["qo"][-1], p["heads"], p["ckv"]) and q_pe.shape[-1] == p["kpe"]
        assert q_nope.dtype == p["q_dtype"] and ckv_cache.dtype == p["kv_dtype"]
        assert ckv_cache.shape[1:] == (p["page"], p["ckv"]) and kpe_cache.shape[1:] == (p["page"], p["kpe"])
        out = torch.empty_like(q_nope)
        for i in range(len(p["lens"])):
            pages = p["pages"][p["kv"][i]:p["kv"][i + 1]].long()
            n = p["lens"][i]
            ckv = ckv_cache[pages].reshape(-1, p["ckv"])[:n].double()
            kpe = kpe_cache[pages].reshape(-1, p["kpe"])[:n].double()
            lo, hi = p["qo"][i], p["qo"][i + 1]
            scores = (torch.einsum("qhd,kd->hqk", q_nope[lo:hi].double(), ckv)
                      + torch.einsum("qhd,kd->hqk", q_pe[lo:hi].double(), kpe)) * p["scale"]
            if p["causal"]:  # query j of the request sits at position n - (hi - lo) + j
                q_pos = torch.arange(hi - lo) + n - (hi - lo)
                scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos[:, None], float("-inf"))
            out[lo:hi] = torch.einsum("hqk,kd->qhd", torch.softmax(scores, -1), ckv).to(out.dtype)
        return out


@pytest.fixture
def flashinfer_standin(monkeypatch: pytest.MonkeyPatch) -> type[StandInMLAWrapper]:
    package, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = StandInMLAWrapper  # type: ignore[attr-defined]
    package.mla = mla  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    StandInMLAWrapper.plans = []
    return StandInMLAWrapper


def test_flashinfer_mla_backend_matches_float64(flashinfer_standin: type[StandInMLAWrapper]) -> None:
    """Extend over cached prefixes (causal), decode and mixed steps on shuffled one-token pages."""
    from sglx.attention.llm.flashinfer_mla import FlashInferMLABackend

    gen = torch.Generator().manual_seed(0)
    prefix, steps = [0, 13, 37], [(ForwardMode.EXTEND, [21, 6, 1]), (ForwardMode.DECODE, [1, 1, 1]),
                                  (ForwardMode.MIXED, [1, 4, 1]), (ForwardMode.DECODE, [1, 1, 1])]
    totals = [p + sum(n[i] for _, n in steps) for i, p in enumerate(prefix)]
    paged = PagedLatents.build(prefix, totals, 1, R, DR, torch.float32, "cpu", gen, layer_id=SPEC.layer_id,
                               num_layers=3)  # one-token pages: shuffled slots
    backend = FlashInferMLABackend(BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, 1, paged.r2t,
                                                  paged.pool))
    proj = MLAProjections.from_kv_b_proj(torch.randn(H * (DN + DV), R, generator=gen) * R ** -0.5, SPEC)
    lo = list(prefix)
    for mode, new in steps:
        hi = [a + n for a, n in zip(lo, new)]
        q_nope = torch.randn(sum(new), H, DN, generator=gen)
        q_pe = torch.randn(sum(new), H, DR, generator=gen)
        fresh = paged.new_latents(lo, hi)
        batch = paged.step(mode, lo, hi, backend)
        backend.init_forward_metadata(batch)
        out = backend.forward_mla(q_nope, q_pe, fresh[:, :R], fresh[:, R:], SPEC, proj, batch)
        backend.forward_mla(q_nope, q_pe, fresh[:, :R], fresh[:, R:], SPEC, proj, batch)  # a second layer: no re-plan
        plan = flashinfer_standin.plans[-1]
        assert (plan["causal"], plan["page"], plan["heads"], plan["ckv"], plan["kpe"], plan["scale"]) == (
            not mode.is_decode, 1, H, R, DR, SPEC.scaling)
        ref = paged.reference(q_nope, q_pe, lo, hi, proj, SPEC.scaling)
        for got, want in zip(out.split(new), ref.split(new), strict=True):
            assert (got.double() - want).abs().max().item() < 2e-5
        lo = hi
    assert len(flashinfer_standin.plans) == len(steps)  # one plan per step, shared by the layers


def test_flashinfer_mla_refuses_pages_other_than_one(flashinfer_standin: type[StandInMLAWrapper]) -> None:
    from sglx.attention.llm.flashinfer_mla import FlashInferMLABackend
    from sglx.errors import BackendUnavailableError

    pool = MLATokenKVPool(64, 16, 1, R, DR, torch.float32)
    with pytest.raises(BackendUnavailableError, match="--page-size 1"):
        FlashInferMLABackend(BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, 16,
                                            ReqToTokenPool(2, 32), pool))
