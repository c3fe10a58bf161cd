"""The GEMVs with epilogues (sglx.llm.kernels.gemv_gated / gemv_rotary) against float64 and against the unfused
kernels they replace, and Llama's batch-1 decode route through them.

Runs only under TRITON_INTERPRET=1 (tests/test_gemv.py launches it in a child pytest). Each fused kernel rounds
where the unfused path rounds (the GEMV output to the dtype, then the epilogue's own roundings), so against the
unfused kernels the results agree to a rounding step of the last operation, and against float64 within the
products' error. The same runs at real sizes on the GPU (tests/gpu/test_gemv_fused_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_gemv.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.attention.llm.kv_store import StepKVSlots  # noqa: E402
from sglx.llm.kernels.gemv import GemvConfig, gemv  # noqa: E402
from sglx.llm.kernels.gemv_gated import gemv_gated  # noqa: E402
from sglx.llm.kernels.gemv_rotary import gemv_rotary_store  # noqa: E402

EPS = 1e-5
DTYPES = [torch.bfloat16, torch.float16]


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |got - want| in units of the dtype's epsilon times |want| (plus a floor for values near 0)."""
    scale = want.double().abs().clamp_min(1e-3)
    return ((got.double() - want.double()).abs() / scale).max().item() / torch.finfo(dtype).eps


# ---------------------------------------------------------------- gate_up + SiLU-and-mul

@pytest.mark.parametrize("n_out,k,config", [(20, 96, GemvConfig(4, 32)), (9, 40, GemvConfig(8, 16)),
                                            (16, 64, GemvConfig(2, 64))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_gated_gemv_is_silu_and_mul_of_the_gemv(n_out, k, config, dtype, bias, tma):
    """Both routes (vector loads, TMA boxes: n_out 9 makes the last gate box run into the up rows, k 40 the last
    step read past the weight's columns) equal the GEMV then SiLU-and-mul."""
    from dataclasses import replace

    from sglx.llm.kernels.activation import silu_and_mul

    config = replace(config, tma=tma)

    x = _randn(1, k, seed=k, dtype=dtype, scale=2.0)
    w = _randn(2 * n_out, k, seed=n_out, dtype=dtype, scale=k ** -0.5)
    b = _randn(2 * n_out, seed=5, dtype=dtype) if bias else None
    got = gemv_gated(x, w, b, config=config, interpret=True)
    assert got.shape == (1, n_out) and got.dtype == dtype
    unfused = silu_and_mul(gemv(x, w, b, config=GemvConfig(config.block_n, config.block_k), interpret=True)[0])
    assert torch.equal(got, unfused)
    gu = x.double() @ w.double().t() + (b.double() if bias else 0)
    g, u = gu[:, :n_out], gu[:, n_out:]
    want = g * torch.sigmoid(g) * u
    bound = 4 * torch.finfo(dtype).eps * (g.abs() * u.abs() + (w.double().abs() @ x.double().abs().t()).t()
                                          [:, :n_out] * u.abs() + 1e-3).max().item()
    assert (got.double() - want).abs().max().item() <= bound


def test_gated_gemv_takes_tma_where_a_descriptor_can_address_the_weight(monkeypatch):
    from sglx.llm.kernels import gemv_gated as module

    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert module.tma_route(w, GemvConfig(), interpret=True)
    assert not module.tma_route(w, GemvConfig(tma=False), interpret=True)
    assert not module.tma_route(w, GemvConfig(rms_pass=2), interpret=True)  # the TMA kernel sums in the loop only
    assert not module.tma_route(torch.zeros(8, 12, dtype=torch.bfloat16), GemvConfig(), interpret=True)  # 24-byte rows
    assert not module.tma_route(w, GemvConfig(), interpret=False)  # a CPU tensor has no TMA
    monkeypatch.setattr(module, "_TMA_ON", False)
    assert not module.tma_route(w, GemvConfig(), interpret=True)
    launched = []
    monkeypatch.setattr(module, "_gated_tma", lambda *a: launched.append(a))
    gemv_gated(torch.zeros(1, 64, dtype=torch.bfloat16), w, config=GemvConfig(tma=True), interpret=True)
    assert len(launched) == 1


def test_gated_gemv_refuses_an_odd_or_misfit_weight():
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[2I, 16\]"):
        gemv_gated(x, torch.zeros(7, 16, dtype=torch.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"\[2I, 16\]"):
        gemv_gated(x, torch.zeros(8, 12, dtype=torch.bfloat16), interpret=True)


# ---------------------------------------------------------------- qkv + rotary + K/V store

def _pool(dtype: torch.dtype, kv_cache_dtype: str, hkv: int, d: int):  # noqa: ANN202
    from sglx.llm.kv_cache import TokenKVPool

    return TokenKVPool(16, 1, 1, hkv, d, dtype, kv_cache_dtype)


@pytest.mark.parametrize("hq,hkv,d,k,config", [(4, 2, 16, 48, GemvConfig(4, 16)), (3, 1, 8, 32, GemvConfig(8, 32)),
                                               (2, 2, 32, 40, GemvConfig(2, 64))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_rotary_gemv_equals_gemv_then_rotary_and_store(hq, hkv, d, k, config, dtype, bias, kv_cache_dtype):
    from sglx.llm.kernels.rotary import apply_rotary_and_store_
    from sglx.llm.layers.rotary import RotaryEmbedding

    rows = (hq + 2 * hkv) * d
    x = _randn(1, k, seed=rows, dtype=dtype, scale=2.0)
    w = _randn(rows, k, seed=k, dtype=dtype, scale=k ** -0.5)
    b = _randn(rows, seed=9, dtype=dtype) if bias else None
    cos, sin = RotaryEmbedding(d, 10000.0, None, 512).cos_sin(torch.tensor([37]), dtype)
    loc = torch.tensor([5])
    pools = [_pool(dtype, kv_cache_dtype, hkv, d) for _ in range(2)]
    for p in pools:
        p.k_scale[0], p.v_scale[0] = (0.05, 0.03) if kv_cache_dtype != "auto" else (1.0, 1.0)

    def slots(pool) -> StepKVSlots:  # noqa: ANN001
        return StepKVSlots(pool.k_buffer[0], pool.v_buffer[0], loc, float(pool.k_scale[0]), float(pool.v_scale[0]),
                           pool.fp8_dtype)

    q = gemv_rotary_store(x, w, b, cos, sin, hq, hkv, slots(pools[0]), config=config, interpret=True)
    qkv = gemv(x, w, b, config=GemvConfig(config.block_n, config.block_k), interpret=True)[0]
    q2, k2, v2 = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q2, k2, v2 = q2.reshape(1, hq, d).clone(), k2.reshape(1, hkv, d).clone(), v2.reshape(1, hkv, d)
    s = slots(pools[1])
    apply_rotary_and_store_(q2, k2, v2, cos, sin, s.k_buffer, s.v_buffer, loc, s.k_scale, s.v_scale, s.fp8_dtype)
    assert q.shape == (hq, d) and torch.equal(q, q2[0])
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])  # slot 5 written, the others untouched
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
    assert pools[0].k_buffer[0][loc].abs().sum() > 0
    # and against float64: the product, then the NeoX rotation
    full = x.double() @ w.double().t() + (b.double() if bias else 0)
    qd = full[:, :hq * d].reshape(hq, d)
    c, sn = cos.double()[0], sin.double()[0]
    half = d // 2
    rot = torch.cat([-qd[:, half:], qd[:, :half]], dim=-1)
    want = qd * c + rot * sn
    assert (q.double() - want).abs().max().item() <= 8 * torch.finfo(dtype).eps * (want.abs().max().item() + 1)


def test_rotary_gemv_refuses_a_weight_that_is_not_whole_heads():
    slots = StepKVSlots(torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.tensor([1]), 1.0, 1.0, None)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    cos = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole|even D"):
        gemv_rotary_store(x, torch.zeros(30, 16, dtype=torch.bfloat16), None, cos, cos, 2, 1, slots, interpret=True)
    two = StepKVSlots(slots.k_buffer, slots.v_buffer, torch.tensor([1, 2]), 1.0, 1.0, None)
    with pytest.raises(ValueError, match="one token"):
        gemv_rotary_store(x, torch.zeros(32, 16, dtype=torch.bfloat16), None, cos, cos, 2, 1, two, interpret=True)


# ---------------------------------------------------------------- norm scales folded into the weights

def _folded(x: torch.Tensor, w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(W with a random norm scale g folded into its columns, as sglx.llm.layers.norm_folding rounds it, the float64
    product rmsnorm(x) W^T with the unfolded W and g, the bound of one rounding of each product term)."""
    from sglx.llm.layers.norm import RMSNorm
    from sglx.llm.layers.norm_folding import fold_norm_into

    k = x.shape[-1]
    norm = RMSNorm(k, EPS).to(x.dtype)
    norm.weight.data = _randn(k, seed=seed, dtype=x.dtype, scale=0.5) + 1
    g = norm.weight.detach().double().clone()
    folded = w.clone()
    fold_norm_into(norm, folded)
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * g
    terms = normed.abs() @ w.double().abs().t()
    return folded, normed @ w.double().t(), 4 * torch.finfo(x.dtype).eps * terms.max().item()


@pytest.mark.parametrize("rms_pass,tma", [(1, False), (2, False), (None, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gemv_norms_the_row_for_a_folded_weight(rms_pass, tma, dtype):
    n_out, k = 20, 96
    x = _randn(1, k, seed=3, dtype=dtype, scale=3.0)
    w = _randn(2 * n_out, k, seed=4, dtype=dtype, scale=k ** -0.5)
    folded, gu, bound = _folded(x, w, seed=5)
    got = gemv_gated(x, folded, config=GemvConfig(4, 32, rms_pass=rms_pass, tma=tma), interpret=True, rms_eps=EPS)
    g, u = gu[:, :n_out], gu[:, n_out:]
    want = g * torch.sigmoid(g) * u
    assert (got.double() - want).abs().max().item() <= bound * (g.abs().max() + u.abs().max()).item() + 1e-3
    unnormed = gemv_gated(x, folded, config=GemvConfig(4, 32), interpret=True)
    assert (unnormed.double() - want).abs().max().item() > 10 * bound  # the norm is really applied


@pytest.mark.parametrize("rms_pass", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_gemv_norms_the_row_for_a_folded_weight(rms_pass, dtype):
    from sglx.llm.layers.rotary import RotaryEmbedding

    hq, hkv, d, k = 4, 2, 16, 48
    rows = (hq + 2 * hkv) * d
    x = _randn(1, k, seed=6, dtype=dtype, scale=3.0)
    w = _randn(rows, k, seed=7, dtype=dtype, scale=k ** -0.5)
    folded, full, bound = _folded(x, w, seed=8)
    cos, sin = RotaryEmbedding(d, 10000.0, None, 512).cos_sin(torch.tensor([37]), dtype)
    pool = _pool(dtype, "auto", hkv, d)
    loc = torch.tensor([3])
    slots = StepKVSlots(pool.k_buffer[0], pool.v_buffer[0], loc, 1.0, 1.0, None)
    q = gemv_rotary_store(x, folded, None, cos, sin, hq, hkv, slots, config=GemvConfig(4, 16, rms_pass=rms_pass),
                          interpret=True, rms_eps=EPS)
    c, sn = cos.double()[0], sin.double()[0]
    half = d // 2

    def rotated(t: torch.Tensor) -> torch.Tensor:
        return t * c + torch.cat([-t[:, half:], t[:, :half]], dim=-1) * sn

    want_q = rotated(full[:, :hq * d].reshape(hq, d))
    want_k = rotated(full[:, hq * d:(hq + hkv) * d].reshape(hkv, d))
    want_v = full[:, (hq + hkv) * d:].reshape(hkv, d)
    tol = 2 * bound + 2 * torch.finfo(dtype).eps * full.abs().max().item()
    assert (q.double() - want_q).abs().max().item() <= tol
    assert (pool.k_buffer[0][3].double() - want_k).abs().max().item() <= tol
    assert (pool.v_buffer[0][3].double() - want_v).abs().max().item() <= tol


# ---------------------------------------------------------------- Llama's batch-1 decode route

def _decode_logits(model_dir, monkeypatch, epilogues: bool, feed: list[int] | None,  # noqa: ANN001, ANN202
                   fold: bool = False):
    """bfloat16 tiny Llama, fused kernels forced on the CPU (interpreted), the backend lending its pool slots, the
    norm-inside width lowered below the model's so the epilogue route applies (`fold`: with the norm scales folded
    into the projections at load): a 9-token extend, then 4 one-token decode steps (teacher-forced by `feed` when
    given)."""
    from llm_test_utils import PagedKVHarness
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.llm.layers import linear, mlp, norm, norm_folding, rotary
    from sglx.llm.models import llama, load_model

    for module in (norm, mlp, rotary, linear):
        monkeypatch.setattr(module, "use_fused", lambda t: True)
    monkeypatch.setattr(norm_folding, "_FOLD_ON", fold)
    monkeypatch.setattr(norm, "NORM_INSIDE_MAX_INPUTS", 16)
    monkeypatch.setattr(llama, "rotary_and_store", _interpreted_rotary_and_store)
    monkeypatch.setattr(TorchNativeBackend, "lends_pool_slots", True)
    monkeypatch.setattr(norm, "_EPILOGUES_ON", epilogues)
    monkeypatch.setattr(linear, "_SKINNY_ON", False)  # the extend's rows: F.linear (the skinny GEMM has its tests)
    model, _ = load_model(model_dir, torch.bfloat16, "cpu")
    harness = PagedKVHarness(model, page_size=4)
    row = harness.new_request()
    logits = [harness.extend([(row, [5, 77, 201, 9, 33, 140, 61, 2, 18])])]
    fed = []
    for step in range(4):
        token = feed[step] if feed is not None else int(logits[-1].argmax(-1))
        fed.append(token)
        logits.append(harness.decode([(row, token)]))
    return [t.float() for t in logits], fed


def _interpreted_rotary_and_store(q, k, v, cos, sin, slots):  # noqa: ANN001, ANN202
    from sglx.llm.kernels.rotary import apply_rotary_and_store_

    apply_rotary_and_store_(q, k, v.reshape(v.shape[0], k.shape[1], -1), cos, sin, slots.k_buffer, slots.v_buffer,
                            slots.loc, slots.k_scale, slots.v_scale, slots.fp8_dtype)
    return True


def test_llama_batch1_decode_through_the_fused_gemvs_equals_the_unfused_kernels(tmp_path, monkeypatch):
    """Each decode step takes qkv + rotary + K/V store and gate_up + SiLU-and-mul (counted) and gives the logits of
    the route with the rotary and SiLU kernels after plain GEMVs: the same roundings, so the same numbers."""
    from llm_test_utils import make_tiny_model
    from sglx.llm.kernels import gemv_gated, gemv_rotary

    model_dir = make_tiny_model(tmp_path, "llama")
    plain, fed = _decode_logits(model_dir, monkeypatch, False, None)
    calls: list[str] = []
    for module, name in ((gemv_gated, "gemv_gated"), (gemv_rotary, "gemv_rotary_store")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    fused, _ = _decode_logits(model_dir, monkeypatch, True, fed)
    layers = 2  # make_tiny_model's llama
    assert calls.count("gemv_rotary_store") == 4 * layers and calls.count("gemv_gated") == 4 * layers
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert fused[1].abs().max() < 100  # real logits of the tiny model, not overflowed garbage
    assert [int(x.argmax(-1)) for x in fused[:-1]] == fed


def test_llama_batch1_decode_with_folded_norms_launches_no_layer_norm(tmp_path, monkeypatch):
    """With the norm scales folded into qkv and gate_up, a decode step runs each layer as the qkv GEMV (norm,
    rotary, K/V store), attention, o_proj adding to the stream, gate_up (norm, SiLU) and down adding to the stream:
    only the final norm is a norm kernel. The logits stay within the bf16 roundings the fold moves (the folded
    weights' one rounding, the normed row's two skipped) of the unfolded route's, and greedy tokens agree."""
    from llm_test_utils import make_tiny_model
    from sglx.llm.kernels import gemv, rmsnorm

    model_dir = make_tiny_model(tmp_path, "llama")
    plain, fed = _decode_logits(model_dir, monkeypatch, True, None)
    calls: list[str] = []
    real_gemv, real_norm = gemv.gemv, rmsnorm._launch
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: calls.append("add" if kw.get("add_to") is not None else "gemv")
                        or real_gemv(*a, **kw))
    monkeypatch.setattr(rmsnorm, "_launch", lambda *a, **kw: calls.append("norm") or real_norm(*a, **kw))
    folded, _ = _decode_logits(model_dir, monkeypatch, True, fed, fold=True)
    layers, steps = 2, 4
    decode_calls = calls[calls.index("add"):]  # after the extend (norm kernels, F.linear)
    assert decode_calls.count("add") == 2 * layers * steps
    assert decode_calls.count("norm") == steps  # the final norm only
    for a, b in zip(folded, plain):
        assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
    assert [int(x.argmax(-1)) for x in folded[1:]] == [int(x.argmax(-1)) for x in plain[1:]]
