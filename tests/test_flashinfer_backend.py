"""flashinfer and trtllm_mha backends on CPU: page tables, registry and doctor reasons, errors, and the wrapper
logic against float64 stand-ins of FlashInfer's documented contracts.

FlashInfer runs only on a GPU (tests/gpu/test_flashinfer_gpu.py judges the real kernels there). Here
stand-ins with the documented behaviour of `BatchPrefillWithPagedKVCacheWrapper`, `...RaggedKVCacheWrapper`,
`BatchDecodeWithPagedKVCacheWrapper` (page indptr/indices/last_page_len, NHD pages, queries aligned with the
END of their keys, inclusive window_left, soft-cap, k_scale/v_scale) and `trtllm_batch_decode_with_kv_cache`
(dense block tables, bmm1/bmm2 scales) compute attention in float64 from exactly what sglx hands them, and the
result must equal the torch_native reference backend step by step.
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from sglx.attention.kernels.page_table import page_table_torch, paged_lengths
from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.llm.torch_native import TorchNativeBackend
from sglx.attention.registry import availability, find
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardMode
from triton_interpreted.launch import run_interpreted
from triton_interpreted.paged import make_paged_cache, step_batch

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ---------------------------------------------------------------- page tables


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_paged_lengths_and_torch_table_match_a_token_walk(page: int) -> None:
    rng = random.Random(page)
    for _ in range(5):
        bs = rng.randint(1, 9)
        cache = make_paged_cache([rng.randint(1, 4 * page + 5) for _ in range(bs)], page, 1, 8, torch.float32,
                                 seed=rng.randint(0, 99), fill=[0] * bs)
        lens = [int((cache.r2t.req_to_token[r] != 0).sum()) for r in cache.rows]  # slots are never 0 (padding page)
        indptr, indices, last = page_table_torch(cache.r2t.req_to_token, torch.tensor(cache.rows), lens, page)
        pos = 0
        for i, (row, n) in enumerate(zip(cache.rows, lens)):
            pages = indices[indptr[i]:indptr[i + 1]].tolist()
            assert 1 <= last[i] <= page and (len(pages) - 1) * page + int(last[i]) == n
            for t in range(n):  # every token's slot is on the page the table names, at its offset
                assert int(cache.r2t.req_to_token[row, t]) == pages[t // page] * page + t % page
            pos += len(pages)
        assert paged_lengths(lens, page) == (indptr.tolist(), last.tolist()) and pos == indptr[-1]


def test_page_table_kernel_under_the_interpreter() -> None:
    run_interpreted("page_table_cases.py")


# ---------------------------------------------------------------- registry, doctor, errors


def test_registry_declares_what_sglx_implements() -> None:
    fi, trt = find("flashinfer", "llm", "mha"), find("trtllm_mha", "llm", "mha")
    assert fi.factory == "sglx.attention.llm.flashinfer:FlashInferBackend"
    assert trt.factory == "sglx.attention.llm.trtllm_mha:TrtllmMHABackend"
    for s, sizes in ((fi, None), (trt, (16, 32, 64))):
        f = s.features
        got = (f.native_paging, f.fp8_kv, f.fp4_kv, f.spec_topk1, f.spec_topk_gt1, f.sliding_window, f.cuda_graph)
        assert got == (True, True, False, False, False, True, True)
        assert (f.page_sizes.sizes if f.page_sizes else None) == sizes
        assert s.load().supports_cuda_graph  # importing the module needs no flashinfer
    assert [p.name for p in fi.config] == ["decode_tensor_cores"]


def test_doctor_reasons_on_this_cpu_machine() -> None:
    from sglx import platform

    snap = platform.current()
    if snap.device_kind != "cpu" or snap.package("flashinfer").installed:
        pytest.skip("states the reasons of a CPU machine without flashinfer")
    for name in ("flashinfer", "trtllm_mha"):
        reasons = availability(find(name, "llm", "mha"), snap).reasons
        assert reasons == ("runs on CUDA only; this machine is CPU",
                           "package flashinfer is not installed (pip install 'sglx[flashinfer]')")


def test_doctor_reasons_on_gpus() -> None:
    from sglx.attention.request import AttentionRequest
    from sglx.platform import fake

    h100 = fake("cuda", gpu="NVIDIA H100", capability=(9, 0), cuda="12.4", packages=("flashinfer",))
    t4 = fake("cuda", gpu="Tesla T4", capability=(7, 5), cuda="12.4", packages=("flashinfer",))
    a100 = fake("cuda", gpu="NVIDIA A100", capability=(8, 0), cuda="12.4", packages=("flashinfer",))
    fi, trt = find("flashinfer", "llm", "mha"), find("trtllm_mha", "llm", "mha")
    assert availability(fi, h100).ok and availability(trt, h100).ok
    assert availability(fi, t4).reasons == ("needs compute capability >= 8.0, this GPU (Tesla T4) is 7.5",)
    assert availability(trt, a100).reasons == (
        "needs compute capability 9.0, 10.x, 12.x, this GPU (NVIDIA A100) is 8.0",)
    req = AttentionRequest(page_size=8, head_dim=80, dtype="float32")
    trt_reasons = availability(trt, h100, req).reasons
    assert "page size 8 is not supported: trtllm_mha needs --page-size 16, 32, 64" in trt_reasons
    assert "head dim 80 is not supported: needs one of 64, 128, 256" in trt_reasons
    assert "dtype float32 is not supported: needs float16 or bfloat16 (--dtype)" in trt_reasons
    assert availability(fi, h100, AttentionRequest(page_size=8, head_dim=128)).ok


@pytest.mark.parametrize("page", [1, 8, 128])
def test_trtllm_page_size_error_names_the_valid_sizes(page: int) -> None:
    from sglx.attention.llm.trtllm_mha import check_page_size

    with pytest.raises(BackendUnavailableError, match=rf"--page-size {page}: .*page sizes 16, 32, 64 only"):
        check_page_size(page)
    for ok in (16, 32, 64):
        check_page_size(ok)


def test_without_flashinfer_the_backends_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglx.attention.llm.flashinfer import FlashInferBackend
    from sglx.attention.llm.trtllm_mha import TrtllmMHABackend

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    cache = make_paged_cache([5], 16, 2, 64, torch.float16)
    for cls in (FlashInferBackend, TrtllmMHABackend):
        ctx = BackendContext(torch.device("cpu"), torch.float16, 4, 2, 64, 16, cache.r2t, cache.pool)
        with pytest.raises(BackendUnavailableError, match=f"attention backend {cls.name} needs the flashinfer "
                                                          "package, which does not import here"):
            cls(ctx)


def test_with_flashinfer_on_cpu_the_device_is_the_reason(flashinfer_standin: types.ModuleType) -> None:
    from sglx.attention.llm.flashinfer import FlashInferBackend

    cache = make_paged_cache([5], 4, 2, 64, torch.float16)
    ctx = BackendContext(torch.device("cpu"), torch.float16, 4, 2, 64, 4, cache.r2t, cache.pool)
    with pytest.raises(BackendUnavailableError, match="runs on CUDA GPUs only; this device is cpu"):
        FlashInferBackend(ctx)


def test_tensor_core_decode_rule() -> None:
    from sglx.attention.llm.flashinfer import use_tensor_core_decode, window_left

    assert use_tensor_core_decode(32, 8, torch.bfloat16) and not use_tensor_core_decode(8, 8, torch.float16)
    assert use_tensor_core_decode(8, 8, torch.float8_e4m3fn)
    assert window_left(LayerSpec(0, 4, 2, 64, 0.1, sliding_window=10)) == 9
    assert window_left(LayerSpec(0, 4, 2, 64, 0.1)) == -1


# ---------------------------------------------------------------- stand-ins of FlashInfer's wrappers


def attend_pages(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, pages: torch.Tensor, n: int,
                 p: dict, k_scale: float | None, v_scale: float | None) -> torch.Tensor:
    """float64: q [Lq, Hq, D] are the LAST Lq positions of a request with n keys on `pages` (NHD)."""
    keys = k_pages[pages.long()].reshape(-1, *k_pages.shape[2:])[:n].double() * (k_scale or 1.0)
    values = v_pages[pages.long()].reshape(-1, *v_pages.shape[2:])[:n].double() * (v_scale or 1.0)
    return attend_dense(q, keys, values, p)


def attend_dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: dict) -> torch.Tensor:
    n, lq = keys.shape[0], q.shape[0]
    group = q.shape[1] // keys.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.repeat_interleave(group, 1)) * p["sm_scale"]
    if p["logits_soft_cap"] > 0:
        scores = p["logits_soft_cap"] * torch.tanh(scores / p["logits_soft_cap"])
    q_pos = torch.arange(n - lq, n)[:, None]
    k_pos = torch.arange(n)[None, :]
    mask = k_pos <= q_pos if p.get("causal", True) else torch.ones(lq, n, dtype=torch.bool)
    if p["window_left"] >= 0:
        mask &= k_pos >= q_pos - p["window_left"]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values.repeat_interleave(group, 1))


class StandIn:
    """Records every plan; checks the argument types the real wrappers require."""

    plans: list[tuple[str, dict]] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, backend: str = "auto", **buffers: torch.Tensor) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8 and workspace.numel() >= 1 << 20
        self.tensor_cores, self.backend = use_tensor_cores, backend

    def _record(self, kind: str, p: dict) -> None:
        for name in ("qo_indptr", "kv_indptr", "indices", "last"):
            if name in p:
                assert p[name].dtype == torch.int32, name
        self.p = p
        StandIn.plans.append((kind, p))


class StandInRagged(StandIn):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,  # noqa: ANN001
             causal=False, window_left=-1, logits_soft_cap=None, sm_scale=None, q_data_type=None,
             kv_data_type=None) -> None:
        self._record("ragged", dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, causal=causal, window_left=window_left,
                                    logits_soft_cap=logits_soft_cap or 0.0, sm_scale=sm_scale, q=q_data_type,
                                    kv=kv_data_type, heads=(num_qo_heads, num_kv_heads, head_dim_qk)))

    def run(self, q, k, v) -> torch.Tensor:  # noqa: ANN001
        p = self.p
        assert q.dtype == p["q"] and k.dtype == p["kv"] and q.shape[1:] == (p["heads"][0], p["heads"][2])
        qo, kv = p["qo_indptr"].tolist(), p["kv_indptr"].tolist()
        out = torch.empty_like(q)
        for i in range(len(qo) - 1):
            out[qo[i]:qo[i + 1]] = attend_dense(q[qo[i]:qo[i + 1]], k[kv[i]:kv[i + 1]].double(),
                                                v[kv[i]:kv[i + 1]].double(), p).to(q.dtype)
        return out


class StandInPaged(StandIn):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,  # noqa: ANN001
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, causal=False, window_left=-1,
             logits_soft_cap=None, sm_scale=None, q_data_type=None, kv_data_type=None) -> None:
        self._record("paged", dict(qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, indices=paged_kv_indices,
                                   last=paged_kv_last_page_len, page=page_size, causal=causal,
                                   window_left=window_left, logits_soft_cap=logits_soft_cap or 0.0,
                                   sm_scale=sm_scale, q=q_data_type, kv=kv_data_type))

    def run(self, q, paged_kv_cache, k_scale=None, v_scale=None) -> torch.Tensor:  # noqa: ANN001
        p = self.p
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape[1] == p["page"] and k_pages.dtype == p["kv"] and q.dtype == p["q"]
        qo, kv, last = p["qo_indptr"].tolist(), p["kv_indptr"].tolist(), p["last"].tolist()
        out = torch.empty_like(q)
        for i in range(len(qo) - 1):
            pages = p["indices"][kv[i]:kv[i + 1]]
            n = (len(pages) - 1) * p["page"] + last[i]
            out[qo[i]:qo[i + 1]] = attend_pages(q[qo[i]:qo[i + 1]], k_pages, v_pages, pages, n, p, k_scale,
                                                v_scale).to(q.dtype)
        return out


class StandInDecode(StandIn):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,  # noqa: ANN001
             window_left=-1, logits_soft_cap=None, sm_scale=None, q_data_type=None, kv_data_type=None) -> None:
        bs = len(last_page_len)
        self._record("decode", dict(qo_indptr=torch.arange(bs + 1, dtype=torch.int32), kv_indptr=indptr,
                                    indices=indices, last=last_page_len, page=page_size, window_left=window_left,
                                    logits_soft_cap=logits_soft_cap or 0.0, sm_scale=sm_scale, q=q_data_type,
                                    kv=kv_data_type, tensor_cores=self.tensor_cores))

    run = StandInPaged.run


def standin_trtllm_decode(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len,  # noqa: ANN001
                          bmm1_scale=1.0, bmm2_scale=1.0, window_left=-1, kv_layout="HND") -> torch.Tensor:
    """trtllm_batch_decode_with_kv_cache's contract: dense [bs, pages] tables, scores scaled by bmm1, out by bmm2."""
    assert kv_layout == "NHD" and block_tables.dtype == seq_lens.dtype == torch.int32
    k_pages, v_pages = kv_cache
    page = k_pages.shape[1]
    assert block_tables.shape[1] * page <= max_seq_len and workspace_buffer.eq(0).all()
    StandIn.plans.append(("trtllm", dict(tables=block_tables.clone(), lens=seq_lens.tolist(), page=page)))
    p = dict(sm_scale=bmm1_scale, logits_soft_cap=0.0, window_left=window_left)
    out = torch.empty_like(query)
    for i, n in enumerate(seq_lens.tolist()):
        pages = block_tables[i, :-(-n // page)]
        out[i:i + 1] = (attend_pages(query[i:i + 1], k_pages, v_pages, pages, n, p, None, None) * bmm2_scale
                        ).to(query.dtype)
    return out


@pytest.fixture
def flashinfer_standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    package, decode = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.decode")
    package.BatchPrefillWithRaggedKVCacheWrapper = StandInRagged  # type: ignore[attr-defined]
    package.BatchPrefillWithPagedKVCacheWrapper = StandInPaged  # type: ignore[attr-defined]
    package.BatchDecodeWithPagedKVCacheWrapper = StandInDecode  # type: ignore[attr-defined]
    decode.trtllm_batch_decode_with_kv_cache = standin_trtllm_decode  # type: ignore[attr-defined]
    package.decode = decode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    StandIn.plans = []
    return package


STEPS = [(ForwardMode.EXTEND, [9, 23, 4]), (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [5, 1, 17]),
         (ForwardMode.MIXED, [1, 6, 1]), (ForwardMode.DECODE, [1, 1, 1])]


def run_steps(name: str, page: int, kv_cache_dtype: str, layers: list[LayerSpec], monkeypatch: pytest.MonkeyPatch,
              config: dict | None = None, calibrate: bool = False, keep: tuple[int, ...] = ()) -> list[str]:
    """Each step through `name` (on the CPU, device check lifted) and torch_native on twin caches; outputs equal.

    `calibrate`: both fp8 pools get per-layer scales from the first prefill over rotated keys
    (`--kv-cache-scales calibrate`), so `name` must rotate its queries on the paged paths; `keep`: those layers
    stay in the model dtype (`--kv-cache-dtype-skip-layers`, with `calibrate`)."""
    import sglx.attention.llm.flashinfer as fi_mod

    monkeypatch.setattr(fi_mod, "check_context", lambda backend, ctx: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hq, hkv, dim = layers[0].num_q_heads, layers[0].num_kv_heads, layers[0].head_dim
    total = [sum(n[i] for _, n in STEPS) for i in range(3)]
    scales = (1.5, 0.5) if kv_cache_dtype != "auto" else (1.0, 1.0)
    caches = [make_paged_cache(total, page, hkv, dim, torch.float32, kv_cache_dtype=kv_cache_dtype, scales=scales,
                               fill=[0, 0, 0], seed=page) for _ in range(2)]
    for c in caches:  # one pool layer per LayerSpec
        for _ in layers[1:]:
            c.pool.k_buffer.append(torch.zeros_like(c.pool.k_buffer[0]))
            c.pool.v_buffer.append(torch.zeros_like(c.pool.v_buffer[0]))
            c.pool.k_scale.append(scales[0])
            c.pool.v_scale.append(scales[1])
        if calibrate:
            c.pool.num_layers = len(layers)
            c.pool.calibrate_static_scales(rotate_keys=True)
            c.pool.keep_unquantized(keep)
    mine = find(name, "llm", "mha").load()(BackendContext(torch.device("cpu"), torch.float32, hq, hkv, dim, page,
                                                          caches[0].r2t, caches[0].pool, config or {}))
    ref = TorchNativeBackend(BackendContext(torch.device("cpu"), torch.float32, hq, hkv, dim, page, caches[1].r2t,
                                            caches[1].pool))
    gen = torch.Generator().manual_seed(7)
    lo = [0, 0, 0]
    phases = []
    for mode, new in STEPS:
        hi = [a + n for a, n in zip(lo, new)]
        outs = []
        q = torch.randn(sum(new), hq, dim, generator=gen)
        for cache, backend in zip(caches, (mine, ref)):
            batch = step_batch(cache, mode, lo, new)
            k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_keys, lo, hi)])
            v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_values, lo, hi)])
            backend.init_forward_metadata(batch)
            outs.append([backend.forward(q, k * (j + 1), v - j, layer, batch) for j, layer in enumerate(layers)])
        phases.append(StandIn.plans[-1][0])
        for got, want in zip(*outs):
            # ragged steps read this step's raw K/V, the reference reads them back from the (fp8) pool
            tol = 0.3 if kv_cache_dtype != "auto" and phases[-1] == "ragged" else 1e-5
            assert (got - want).abs().max().item() <= tol, (mode, phases[-1])
        if calibrate:  # both pools froze the same scales from the first prefill (this step's K/V)
            assert not any(caches[0].pool.scales_pending) and caches[0].pool.k_scale == caches[1].pool.k_scale
            fp8 = [i for i in range(len(layers)) if i not in keep]
            assert all(caches[0].pool.k_scale[i] != 1.0 != caches[0].pool.v_scale[i] for i in fp8)
            assert all(caches[0].pool.k_scale[i] == 1.0 == caches[0].pool.v_scale[i] for i in keep)
        lo = hi
    return phases


@pytest.mark.parametrize("page", [1, 4, 16])
def test_flashinfer_wrappers_get_what_their_contract_needs(flashinfer_standin, monkeypatch, page: int) -> None:
    """Fresh prefill ragged, prefix hits paged, decode paged; two layer kinds (window + cap vs full) plan apart."""
    layers = [LayerSpec(0, 8, 2, 64, 0.11, sliding_window=7, logit_cap=2.0), LayerSpec(1, 8, 2, 64, 0.125)]
    phases = run_steps("flashinfer", page, "auto", layers, monkeypatch)
    assert phases == ["ragged", "decode", "paged", "paged", "decode"]
    kinds = [(k, p["window_left"], p["logits_soft_cap"], p["sm_scale"]) for k, p in StandIn.plans]
    assert kinds[:2] == [("ragged", 6, 2.0, 0.11), ("ragged", -1, 0.0, 0.125)]
    # from the second step on, init_forward_metadata plans every known kind once (two plans a step)
    assert len(StandIn.plans) == 2 * len(STEPS)
    assert all(p["tensor_cores"] for k, p in StandIn.plans if k == "decode")  # GQA group of 4


def test_flashinfer_fp8_pool_views_and_scales(flashinfer_standin, monkeypatch) -> None:
    layers = [LayerSpec(0, 4, 4, 64, 0.125)]
    run_steps("flashinfer", 16, "fp8_e4m3", layers, monkeypatch, {"decode_tensor_cores": "off"})
    decode = [p for k, p in StandIn.plans if k == "decode"]
    assert decode and all(p["kv"] == torch.float8_e4m3fn and not p["tensor_cores"] for p in decode)


@pytest.mark.parametrize("page", [16, 64])
def test_trtllm_decode_block_tables_and_flashinfer_prefill(flashinfer_standin, monkeypatch, page: int) -> None:
    layers = [LayerSpec(0, 8, 2, 64, 0.1, sliding_window=12), LayerSpec(1, 8, 2, 64, 0.1)]
    phases = run_steps("trtllm_mha", page, "fp8_e4m3", layers, monkeypatch)
    assert phases == ["ragged", "trtllm", "paged", "paged", "trtllm"]


@pytest.mark.parametrize("name", ["flashinfer", "trtllm_mha"])
def test_calibrated_per_layer_scales_with_rotated_queries(flashinfer_standin, monkeypatch, name: str) -> None:
    """--kv-cache-scales calibrate: the paged prefill and decode read rotated keys with one scale per layer and
    must rotate their queries; the float64 stand-ins then equal torch_native over the same pool bytes."""
    layers = [LayerSpec(0, 8, 2, 64, 0.1, sliding_window=12), LayerSpec(1, 8, 2, 64, 0.125)]
    phases = run_steps(name, 16, "fp8_e4m3", layers, monkeypatch, calibrate=True)
    decode = "trtllm" if name == "trtllm_mha" else "decode"
    assert phases == ["ragged", decode, "paged", "paged", decode]


@pytest.mark.parametrize("name", ["flashinfer", "trtllm_mha"])
def test_layers_kept_in_the_model_dtype_get_plans_of_their_own(flashinfer_standin, monkeypatch, name: str) -> None:
    """--kv-cache-dtype-skip-layers 1 over calibrated fp8 scales: layer 1's pages are read as the model dtype (its
    own plans, scales 1.0), layer 0's as e4m3 with its scales; both equal torch_native over the same pool."""
    layers = [LayerSpec(0, 8, 2, 64, 0.125), LayerSpec(1, 8, 2, 64, 0.125)]
    phases = run_steps(name, 16, "fp8_e4m3", layers, monkeypatch, calibrate=True, keep=(1,))
    decode = "trtllm" if name == "trtllm_mha" else "decode"
    assert phases == ["ragged", decode, "paged", "paged", decode]
    paged = [p["kv"] for k, p in StandIn.plans if k in ("paged", "decode")]
    assert paged.count(torch.float32) == paged.count(torch.float8_e4m3fn) > 0  # one plan per dtype a step
    # same LayerSpec numbers, two kinds: a layer kept in the model dtype never shares the fp8 layer's plan
    assert len([k for k, _ in StandIn.plans if k == "ragged"]) == 2


def test_a_per_token_scale_pool_is_switched_to_per_layer_scales(flashinfer_standin, monkeypatch) -> None:
    """FlashInfer applies one K and one V scale per layer: the (still empty) pool gets static ones, calibrated
    from the first prefill over rotated keys (--kv-cache-scales auto's choice for such backends)."""
    import inspect

    import sglx.attention.llm.flashinfer as fi_mod
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

    if "per_token_scales" not in inspect.signature(TokenKVPool).parameters:
        pytest.skip("this KV pool has per-layer scales only")
    monkeypatch.setattr(fi_mod, "check_context", lambda backend, ctx: None)
    pool = TokenKVPool(64, 16, 2, 2, 64, torch.float16, "fp8_e4m3", per_token_scales=True)
    assert pool.per_token_scales
    fi_mod.FlashInferBackend(BackendContext(torch.device("cpu"), torch.float16, 4, 2, 64, 16, ReqToTokenPool(2, 32),
                                            pool))
    assert not pool.per_token_scales and pool.k_scale == [1.0, 1.0] and pool.v_scale == [1.0, 1.0]
    assert pool.scales_pending == [True, True] and pool.k_rotation is not None
    assert fi_mod.layer_scales(pool, 1) == (None, None)  # until the first prefill stores


# ---------------------------------------------------------------- cheap re-plan of captured decode graphs


class _RecordingModule:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def plan(self, *args):
        self.calls.append(args)
        return ("plan_info", len(self.calls))


class _GraphDecodeWrapper:
    """The attributes FlashInfer 0.5.x's graph-mode tensor-core decode wrapper has after one full plan."""

    def __init__(self, tensor_cores: bool = True, graph: bool = True) -> None:
        self.use_tensor_cores, self.is_cuda_graph_enabled = tensor_cores, graph
        self._float_workspace_buffer, self._int_workspace_buffer = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
        self._pin_memory_int_workspace_buffer = torch.zeros(4, dtype=torch.int32)
        self._cached_module = _RecordingModule()
        self._plan_info = None


def test_graph_replay_replans_with_the_planner_alone_after_one_full_plan() -> None:
    from sglx.attention.llm.flashinfer import remember_graph_plan, replan_graph_decode

    key = (32, 8, 128, 16, -1)
    lens = [5, 17, 33]
    indptr = torch.tensor(paged_lengths(lens, 16)[0], dtype=torch.int32)
    w = _GraphDecodeWrapper()
    assert not replan_graph_decode(w, indptr, lens, key)  # never fully planned: the caller must run plan()
    remember_graph_plan(w, key)
    assert not replan_graph_decode(w, indptr, lens, (32, 8, 128, 16, 63))  # another window: full plan
    assert replan_graph_decode(w, indptr, lens, key)
    (args,) = w._cached_module.calls
    # exactly what BatchDecodeWithPagedKVCacheWrapper.plan passes its planner in graph mode with tensor cores
    assert args[0] is w._float_workspace_buffer and args[1] is w._int_workspace_buffer
    assert args[2] is w._pin_memory_int_workspace_buffer
    assert args[3].tolist() == [0, 1, 2, 3] and args[3].dtype == torch.int32  # one query row per request
    assert args[4].tolist() == [0, 1, 3, 6] and args[5].tolist() == lens and args[5].dtype == torch.int32
    assert args[6:] == (3, 3, 32, 8, 16, True, 128, 128, False, -1, -1, False, 0)
    assert w._plan_info == ("plan_info", 1) and w._max_kv_len == 33
    for other in (_GraphDecodeWrapper(tensor_cores=False), _GraphDecodeWrapper(graph=False)):
        remember_graph_plan(other, key)  # CUDA-core decode and eager wrappers plan in full
        assert not replan_graph_decode(other, indptr, lens, key) and not other._cached_module.calls


def test_decode_queries_go_in_strided_prefill_queries_contiguous() -> None:
    """FlashInfer's decode kernels read q through its token/head strides: a view of the fused qkv rows goes in as
    it is (no copy); prefill paths and pools that rotate queries get contiguous tensors."""
    from sglx.attention.llm.flashinfer import paged_query

    qkv = torch.randn(5, (4 + 2 * 2) * 8)
    q = qkv[:, :32].reshape(5, 4, 8)  # strides (64, 8, 1): not contiguous
    plain = types.SimpleNamespace()
    assert paged_query(plain, q, strided_ok=True).data_ptr() == q.data_ptr()
    got = paged_query(plain, q)
    assert got.is_contiguous() and torch.equal(got, q)
    rotated = types.SimpleNamespace(rotate_query=lambda x: x * 2)
    assert torch.equal(paged_query(rotated, q, strided_ok=True), q * 2)
