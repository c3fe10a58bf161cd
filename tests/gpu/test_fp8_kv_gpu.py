"""fp8 KV with per-token scales on a real GPU: Triton decode/extend vs float64 over the stored bytes, and
the embedded model's recall through the triton backend (CUDA graphs on).

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_fp8_kv_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

DEV = "cuda"
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _cache(lens, page, hkv, dim, dtype, kv_cache_dtype, fill=None):
    from sglx.attention.kernels.store_kv import store_kv_to_pool
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

    gen = torch.Generator().manual_seed(dim)
    pages = [-(-n // page) for n in lens]
    num_slots = (sum(pages) + 2) * page
    r2t = ReqToTokenPool(len(lens) + 1, max(lens) + page, DEV)
    pool = TokenKVPool(num_slots, page, 1, hkv, dim, dtype, kv_cache_dtype, DEV, per_token_scales=True)
    free = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()
    rows, ks, vs = [], [], []
    for i, n in enumerate(lens):
        row = r2t.alloc()
        mine = [free.pop() for _ in range(pages[i])]
        r2t.req_to_token[row, :n] = torch.tensor([p * page + j for p in mine for j in range(page)][:n], device=DEV)
        k = torch.randn(n, hkv, dim, generator=gen) * (0.1 + 3 * torch.rand(n, 1, 1, generator=gen))
        k[..., :3] *= 12
        ks.append(k.to(DEV, dtype))
        vs.append(torch.randn(n, hkv, dim, generator=gen).to(DEV, dtype))
        rows.append(row)
        stored = n if fill is None else fill[i]
        if stored:
            store_kv_to_pool(pool, 0, ks[i][:stored], vs[i][:stored], r2t.req_to_token[row, :stored].long())
    return r2t, pool, rows, ks, vs


def _held(pool, slots):
    k = pool.k_buffer[0][slots].view(pool.fp8_dtype).double() * pool.k_scale[0][slots][..., None].double()
    v = pool.v_buffer[0][slots].view(pool.fp8_dtype).double() * pool.v_scale[0][slots][..., None].double()
    return k, v


@pytest.mark.parametrize("fp8_convert,fold,block_n,prefetch", [
    (None, None, None, None), ("cast", None, None, None), ("ptx_v", None, None, None), ("ptx_kv", None, None, None),
    ("bits_k", None, None, None), ("bits_k", "tile_max", 128, True), (None, "tile_max", None, None),
    (None, "exponent", 128, None), (None, "tile_max", 128, True),
    (None, "exponent", 64, True), (None, "exponent", 128, False)])
@pytest.mark.parametrize("dtype,page,hq,hkv,dim,kv_cache_dtype", [
    (torch.bfloat16, 16, 32, 8, 128, "fp8_e4m3"), (torch.float16, 1, 16, 2, 64, "fp8_e5m2")])
def test_decode_per_token_scales_match_float64(dtype, page, hq, hkv, dim, kv_cache_dtype, fp8_convert, fold, block_n,
                                               prefetch):
    """Every launch the defaults pick by page size (page 16: 128-key tiles, slots a tile ahead; page 1: 2 stages)
    and the other side of each choice."""
    from sglx.attention.kernels.decode_attention import DecodeConfig, decode_attention, semaphore_count
    from sglx.attention.kernels.kv_indices import build_kv_indptr
    from triton_interpreted.paged import reference_attention

    if fp8_convert is not None and torch.cuda.get_device_capability() < (8, 9) and fp8_convert != "cast":
        pytest.skip("PTX fp8 conversion needs sm_89+")
    if fp8_convert == "bits_k" and kv_cache_dtype != "fp8_e4m3":
        pytest.skip("bits_k is for e4m3 pools and bfloat16 queries")
    lens = [1, 3000, 517, 64]
    r2t, pool, rows, _, _ = _cache(lens, page, hkv, dim, dtype, kv_cache_dtype)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    kv_indices = torch.cat([r2t.req_to_token[r, :n] for r, n in zip(rows, lens)]).int()
    q_rot = pool.rotate_query(torch.randn(len(lens), hq, dim, device=DEV, dtype=dtype))
    out = torch.empty(len(lens), hq, dim, device=DEV, dtype=dtype)
    for merge in (False, True):
        mid_o = torch.empty(len(lens), hq, 16, dim, device=DEV)
        mid_lse = torch.empty(len(lens), hq, 16, device=DEV)
        sems = torch.zeros(semaphore_count(len(lens), hq, hkv), dtype=torch.int32, device=DEV) if merge else None
        decode_attention(q_rot, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                         dim ** -0.5, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype,
                         config=DecodeConfig(fp8_convert=fp8_convert, token_scale_fold=fold, block_n=block_n,
                                             prefetch_slots=prefetch), semaphores=sems, page_size=page)
        for i, n in enumerate(lens):
            k, v = _held(pool, r2t.req_to_token[rows[i], :n].long())
            ref = reference_attention(q_rot[i:i + 1], k, v, torch.tensor([n - 1]), dim ** -0.5)
            err = (out[i:i + 1].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (merge, i, err)


def test_extend_per_token_scales_match_float64():
    from sglx.attention.kernels.extend_attention import extend_attention
    from sglx.attention.kernels.kv_indices import build_kv_indptr
    from sglx.attention.kernels.store_kv import store_kv_to_pool
    from triton_interpreted.paged import reference_attention

    dtype, hq, hkv, dim = torch.bfloat16, 32, 8, 128
    prefix, new = [0, 1000, 300], [700, 1, 129]
    lens = [p + n for p, n in zip(prefix, new)]
    r2t, pool, rows, ks, vs = _cache(lens, 16, hkv, dim, dtype, "fp8_e4m3", fill=prefix)
    loc = torch.cat([r2t.req_to_token[r, p:p + n] for r, p, n in zip(rows, prefix, new)]).long()
    k_new = torch.cat([k[p:] for k, p in zip(ks, prefix)])
    v_new = torch.cat([v[p:] for v, p in zip(vs, prefix)])
    store_kv_to_pool(pool, 0, k_new, v_new, loc)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    kv_indices = torch.cat([r2t.req_to_token[r, :n] for r, n in zip(rows, lens)]).int()
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32, device=DEV))
    q_rot = pool.rotate_query(torch.randn(sum(new), hq, dim, device=DEV, dtype=dtype))
    out = torch.empty(sum(new), hq, dim, device=DEV, dtype=dtype)
    extend_attention(q_rot, pool.k_buffer[0], pool.v_buffer[0], out, qo_indptr, kv_indptr, kv_indices, max(new),
                     dim ** -0.5, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype,
                     k_ext=k_new, v_ext=v_new)
    row = 0
    for i, (p, n) in enumerate(zip(prefix, new)):
        k, v = _held(pool, r2t.req_to_token[rows[i], :p + n].long())
        ref = reference_attention(q_rot[row:row + n], k, v, torch.arange(p, p + n), dim ** -0.5)
        assert (out[row:row + n].double() - ref).abs().max().item() <= TOL[dtype], i
        row += n


def test_embedded_model_recall_with_fp8_kv_on_triton():
    import random

    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
    from sglx.llm.engine import Engine

    rng = random.Random(2024)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(100)]
    with Engine(attention_backend="triton", kv_cache_dtype="fp8_e4m3", device=DEV) as eng:
        assert eng.runner.token_kv_pool.per_token_scales
        results = eng.generate([p for p, _ in examples], {"max_new_tokens": 8, "temperature": 0.0})
    right = sum(normalize_output(r["text"]) == a for r, (_, a) in zip(results, examples))
    assert right / len(examples) >= 0.98, right
