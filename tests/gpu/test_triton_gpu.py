"""sglx's Triton kernels and `triton` backend on a real GPU: bf16/fp16 at real sizes vs float64.

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_triton_gpu.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
DEV = "cuda"


def _indices(cache, lens):
    from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr

    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    kv_indices = torch.empty(sum(lens), dtype=torch.int32, device=DEV)
    build_kv_indices(cache.r2t.req_to_token, torch.tensor(cache.rows, device=DEV), kv_indptr, kv_indices)
    expected = torch.cat([cache.slots(i, 0, n) for i, n in enumerate(lens)]).int()
    assert torch.equal(kv_indices, expected)
    return kv_indptr, kv_indices


DECODE = [
    # (dtype, page, hq, hkv, dim, kv_cache_dtype, scales, window, cap)
    (torch.bfloat16, 1, 32, 8, 128, "auto", (1.0, 1.0), None, 0.0),
    (torch.float16, 16, 32, 8, 128, "auto", (1.0, 1.0), None, 0.0),
    (torch.bfloat16, 16, 16, 2, 64, "auto", (1.0, 1.0), 700, 0.0),
    (torch.float16, 1, 12, 4, 80, "auto", (1.0, 1.0), None, 30.0),
    (torch.bfloat16, 16, 8, 8, 96, "auto", (1.0, 1.0), None, 0.0),
    (torch.float16, 16, 16, 4, 256, "auto", (1.0, 1.0), 1000, 0.0),
    (torch.bfloat16, 16, 32, 8, 128, "fp8_e4m3", (1.6, 0.7), None, 0.0),
    (torch.float16, 1, 64, 4, 128, "fp8_e5m2", (1.0, 1.0), 513, 20.0),
    # K stored as k / 64: most of its e4m3 codes are subnormal (|k| < 1), which bits_k hands to the tensor cores
    # as bfloat16 subnormals; flushing them would move the scores by O(1)
    (torch.bfloat16, 16, 32, 8, 128, "fp8_e4m3", (64.0, 1.0), None, 0.0),
]


FP8_CONVERTS = [None, "cast", "ptx_v", "ptx_kv", "bits_k"]  # None: the default for this device


@pytest.mark.parametrize("merge", ["second-kernel", "last-split", "one-split"])
@pytest.mark.parametrize("fp8_convert", FP8_CONVERTS)
@pytest.mark.parametrize("dtype,page,hq,hkv,dim,kv_cache_dtype,scales,window,cap", DECODE)
def test_decode_real_sizes_match_float64(dtype, page, hq, hkv, dim, kv_cache_dtype, scales, window, cap, fp8_convert,
                                         merge):
    from sglx.attention.kernels.common import num_sms
    from sglx.attention.kernels.decode_attention import (
        DecodeConfig,
        choose_num_kv_splits,
        decode_attention,
        semaphore_count,
    )

    if fp8_convert is not None and (kv_cache_dtype == "auto" or torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("fp8 conversion paths apply to fp8 KV; the PTX ones need sm_89+")
    if fp8_convert == "bits_k" and (kv_cache_dtype != "fp8_e4m3" or dtype != torch.bfloat16):
        pytest.skip("bits_k is for e4m3 pools and bfloat16 queries (else a ValueError: test_fp8_convert_choice.py)")
    from triton_interpreted.paged import make_paged_cache, reference_attention

    lens = [1, 4096, 2500, 17, 1300, 3000, 600, 257]
    cache = make_paged_cache(lens, page, hkv, dim, dtype, device=DEV, kv_cache_dtype=kv_cache_dtype, scales=scales,
                             seed=dim)
    pool = cache.pool
    kv_indptr, kv_indices = _indices(cache, lens)
    q = torch.randn(len(lens), hq, dim, device=DEV, dtype=dtype)
    if merge == "one-split":  # stage 1 writes the output itself (what batches of 1.4+ rows per SM run)
        splits = 1
    else:
        splits = choose_num_kv_splits(len(lens), hkv, max(lens), num_sms(q.device))
        assert splits > 1
    out = torch.full((len(lens), hq, dim), float("nan"), device=DEV, dtype=dtype)
    mid_o = torch.empty(len(lens), hq, splits, dim, device=DEV)
    mid_lse = torch.empty(len(lens), hq, splits, device=DEV)
    sems = (torch.zeros(semaphore_count(len(lens), hq, hkv), dtype=torch.int32, device=DEV)
            if merge == "last-split" else None)
    decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                     dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=pool.k_scale[0],
                     v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype, config=DecodeConfig(fp8_convert=fp8_convert),
                     semaphores=sems)
    torch.cuda.synchronize()
    if sems is not None:
        assert sems.eq(0).all()
    for i, n in enumerate(lens):
        ref = reference_attention(q[i:i + 1], cache.keys[i], cache.values[i], torch.tensor([n - 1]), dim ** -0.5,
                                  window, cap)
        err = (out[i:i + 1].double() - ref).abs().max().item()
        assert err <= TOL[dtype], (i, n, err)


EXTEND = [
    # (dtype, page, hq, hkv, dim, kv_cache_dtype, window, cap)
    (torch.bfloat16, 1, 32, 8, 128, "auto", None, 0.0),
    (torch.float16, 16, 32, 32, 128, "auto", None, 0.0),
    (torch.bfloat16, 16, 8, 2, 64, "auto", 300, 0.0),
    (torch.float16, 1, 8, 4, 80, "auto", None, 25.0),
    (torch.bfloat16, 16, 4, 4, 96, "auto", None, 0.0),
    (torch.float16, 16, 8, 2, 256, "auto", 200, 0.0),
    (torch.bfloat16, 16, 16, 4, 128, "fp8_e4m3", None, 0.0),
]


@pytest.mark.parametrize("ext", [False, True], ids=["pool-only", "new-rows-from-ext"])
@pytest.mark.parametrize("dtype,page,hq,hkv,dim,kv_cache_dtype,window,cap", EXTEND)
def test_extend_real_sizes_match_float64(dtype, page, hq, hkv, dim, kv_cache_dtype, window, cap, ext):
    from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention
    from sglx.attention.kernels.kv_indices import build_kv_indptr
    from triton_interpreted.paged import make_paged_cache, reference_attention

    prefix, new = [0, 1000, 37, 2048, 5], [1500, 300, 1, 700, 129]
    lens = [p + n for p, n in zip(prefix, new)]
    scales = (2.0, 0.5) if kv_cache_dtype != "auto" else (1.0, 1.0)  # powers of two: x / s is exact
    cache = make_paged_cache(lens, page, hkv, dim, dtype, device=DEV, kv_cache_dtype=kv_cache_dtype, scales=scales,
                             fill=prefix, seed=dim + 1)
    pool = cache.pool
    k_new, v_new = cache.store_new(prefix, scales)
    kv_indptr, kv_indices = _indices(cache, lens)
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32, device=DEV))
    q = torch.randn(sum(new), hq, dim, device=DEV, dtype=dtype)
    refs = [reference_attention(q[r:r + n], cache.keys[i], cache.values[i], torch.arange(p, p + n), dim ** -0.5,
                                window, cap)
            for i, (r, p, n) in enumerate(zip([0, *itertools.accumulate(new)], prefix, new))]
    # programs one (request, head) after another, and 8 pairs at a time (the SM90 default for GQA prefill); the
    # unmasked pool loop with its slot ids a tile ahead and without (the default picks by where most keys come from)
    for config in (ExtendConfig(section=0), ExtendConfig(section=8), ExtendConfig(prefetch_slots=True),
                   ExtendConfig(prefetch_slots=False)):
        out = torch.full((sum(new), hq, dim), float("nan"), device=DEV, dtype=dtype)
        extend_attention(q, pool.k_buffer[0], pool.v_buffer[0], out, qo_indptr, kv_indptr, kv_indices, max(new),
                         dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=scales[0], v_scale=scales[1],
                         fp8_dtype=pool.fp8_dtype, k_ext=k_new if ext else None, v_ext=v_new if ext else None,
                         config=config)
        torch.cuda.synchronize()
        row = 0
        for i, n in enumerate(new):
            err = (out[row:row + n].double() - refs[i]).abs().max().item()
            assert err <= TOL[dtype], (config, i, err)
            row += n


def _pool_past_2_31(hkv: int, dim: int, tokens: int, gen: torch.Generator):
    """K/V pools whose element offsets pass int32 (4.3 GB a buffer), `tokens` random keys/values stored on slots on
    both sides of the 2**31 boundary: (k_pool, v_pool, slots, keys, values)."""
    from sglx.attention.kernels.common import offsets_fit_int32

    boundary = 2**31 // (hkv * dim)  # first row whose offset needs 64 bits
    k_pool = torch.zeros(boundary + 4096, hkv, dim, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    assert not offsets_fit_int32(k_pool, v_pool) and offsets_fit_int32(k_pool[:boundary], v_pool[:boundary])
    slots = k_pool.shape[0] - 1 - torch.randperm(8192, generator=gen, device=DEV)[:tokens]
    assert (slots >= boundary).any() and (slots < boundary).any()
    keys = torch.randn(tokens, hkv, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    values = torch.randn(tokens, hkv, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    k_pool[slots], v_pool[slots] = keys, values
    return k_pool, v_pool, slots, keys, values


@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_gathers_past_2_31_pool_elements(prefetch):
    """Decode over a pool whose offsets need 64 bits (SLOT64), split and unsplit."""
    from sglx.attention.kernels.decode_attention import DecodeConfig, decode_attention
    from sglx.attention.kernels.kv_indices import build_kv_indptr
    from triton_interpreted.paged import reference_attention

    hq, hkv, dim = 8, 2, 128
    gen = torch.Generator(device=DEV).manual_seed(1)
    lens = [3000, 1, 700]
    k_pool, v_pool, slots, keys, values = _pool_past_2_31(hkv, dim, sum(lens), gen)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    q = torch.randn(len(lens), hq, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    for splits in (1, 8):
        out = torch.full_like(q, float("nan"))
        mid_o = torch.empty(len(lens), hq, splits, dim, device=DEV)
        mid_lse = torch.empty(len(lens), hq, splits, device=DEV)
        decode_attention(q, k_pool, v_pool, out, kv_indptr, slots.int(), mid_o, mid_lse, dim ** -0.5,
                         config=DecodeConfig(prefetch_slots=prefetch))
        torch.cuda.synchronize()
        for i, n in enumerate(lens):
            k0 = int(kv_indptr[i])
            ref = reference_attention(q[i:i + 1], keys[k0:k0 + n], values[k0:k0 + n], torch.tensor([n - 1]),
                                      dim ** -0.5)
            err = (out[i:i + 1].double() - ref).abs().max().item()
            assert err <= TOL[torch.bfloat16], (splits, i, err)


@pytest.mark.parametrize("prefetch", [False, True])
def test_extend_gathers_past_2_31_pool_elements(prefetch):
    """Extend over a pool whose offsets need 64 bits (SLOT64): prefix tiles (masked and unmasked pool loops) and
    this step's."""
    from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention
    from sglx.attention.kernels.kv_indices import build_kv_indptr
    from triton_interpreted.paged import reference_attention

    hq, hkv, dim = 4, 2, 128
    prefix, new = [2000, 130], [300, 77]
    lens = [p + n for p, n in zip(prefix, new)]
    gen = torch.Generator(device=DEV).manual_seed(0)
    k_pool, v_pool, slots, keys, values = _pool_past_2_31(hkv, dim, sum(lens), gen)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32, device=DEV))
    q = torch.randn(sum(new), hq, dim, device=DEV, dtype=torch.bfloat16, generator=gen)
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k_pool, v_pool, out, qo_indptr, kv_indptr, slots.int(), max(new), dim ** -0.5,
                     prefix_tokens=sum(prefix), config=ExtendConfig(prefetch_slots=prefetch))
    torch.cuda.synchronize()
    row = 0
    for i, (p, n) in enumerate(zip(prefix, new)):
        k0 = int(kv_indptr[i])
        ref = reference_attention(q[row:row + n], keys[k0:k0 + p + n], values[k0:k0 + p + n], torch.arange(p, p + n),
                                  dim ** -0.5)
        err = (out[row:row + n].double() - ref).abs().max().item()
        assert err <= TOL[torch.bfloat16], (i, err)
        row += n


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_store_kv_fp8_agrees_with_the_pool_on_gpu(kv_cache_dtype):
    from sglx.attention.kernels.store_kv import store_kv
    from triton_interpreted.paged import make_paged_cache

    lens = [3000, 1000]
    caches = [make_paged_cache(lens, 16, 8, 128, torch.bfloat16, device=DEV, kv_cache_dtype=kv_cache_dtype,
                               scales=(1.0, 0.3), fill=[0, 0]) for _ in range(2)]
    loc = torch.cat([caches[0].slots(i, 0, n) for i, n in enumerate(lens)])
    k, v = torch.cat(caches[0].raw_keys) * 20, torch.cat(caches[0].raw_values)  # spans many binades, < 448
    mine, theirs = caches[0].pool, caches[1].pool
    store_kv(k, v, mine.k_buffer[0], mine.v_buffer[0], loc, 1.0, 0.3, mine.fp8_dtype)
    theirs.set_kv(0, loc, k, v)
    assert torch.equal(mine.k_buffer[0], theirs.k_buffer[0])  # scale 1: the very same bits
    # scale 0.3: torch divides by multiplying with 1/scale on CUDA, we divide; allow rare one-ulp ties
    differ = (mine.v_buffer[0] != theirs.v_buffer[0]).float().mean().item()
    assert differ < 1e-4


@pytest.mark.parametrize("dtype,page,kv_cache_dtype,window,cap", [
    (torch.bfloat16, 1, "auto", None, 0.0),
    (torch.float16, 16, "auto", 100, 30.0),
    (torch.bfloat16, 16, "fp8_e4m3", None, 0.0),
])
def test_backend_matches_torch_native_on_gpu(dtype, page, kv_cache_dtype, window, cap):
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.attention.llm.triton import TritonBackend
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from triton_interpreted.paged import make_paged_cache

    hq, hkv, dim = 32, 8, 128
    prefix = [0, 200, 1000, 63]
    steps = [(ForwardMode.EXTEND, [300, 40, 1, 500]), (ForwardMode.DECODE, [1, 1, 1, 1]),
             (ForwardMode.MIXED, [1, 7, 1, 33]), (ForwardMode.DECODE, [1, 1, 1, 1])]
    total = [p + sum(s[1][i] for s in steps) for i, p in enumerate(prefix)]
    caches = [make_paged_cache(total, page, hkv, dim, dtype, device=DEV, kv_cache_dtype=kv_cache_dtype,
                               fill=prefix, seed=page) for _ in range(2)]
    backends = [cls(BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, c.r2t, c.pool))
                for cls, c in zip((TritonBackend, TorchNativeBackend), caches)]
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5, sliding_window=window, logit_cap=cap)
    lo = list(prefix)
    for mode, new in steps:
        q = torch.randn(sum(new), hq, dim, device=DEV, dtype=dtype)
        outs = []
        for cache, backend in zip(caches, backends):
            hi = [a + n for a, n in zip(lo, new)]
            batch = ForwardBatch(
                mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=DEV),
                positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(DEV),
                req_pool_indices=torch.tensor(cache.rows, device=DEV), seq_lens=torch.tensor(hi, device=DEV),
                out_cache_loc=torch.cat([cache.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))]),
                req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=hi,
                extend_seq_lens_cpu=list(new) if mode.is_extend else [],
                extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])
            k = torch.cat([kk[a:a + n] for kk, a, n in zip(cache.raw_keys, lo, new)])
            v = torch.cat([vv[a:a + n] for vv, a, n in zip(cache.raw_values, lo, new)])
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k, v, layer, batch))
        err = (outs[0].float() - outs[1].float()).abs().max().item()
        assert err <= TOL[dtype], (mode, err)
        lo = [a + n for a, n in zip(lo, new)]
    assert torch.equal(caches[0].pool.k_buffer[0], caches[1].pool.k_buffer[0])


def test_doctor_check_passes_on_this_gpu():
    from sglx import platform
    from sglx.attention.checks import run_check
    from sglx.attention.registry import find

    result = run_check(find("triton", "llm", "mha"), platform.current())
    assert result.status == "pass", result
