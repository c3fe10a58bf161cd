"""Triton kernels vs float64, run only under TRITON_INTERPRET=1 (tests/test_triton_kernels.py launches this).

Shapes are tiny (the interpreter runs each program in Python) but chosen to cross every code path:
several KV splits and key blocks, ragged requests, page sizes 1 and 16, GQA and MHA, head dims that
are not powers of two, sliding window, soft-cap, fp8 KV with scales, prefix + extend.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_triton_kernels.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.attention.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
    semaphore_count,
)
from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention  # noqa: E402
from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr, build_kv_metadata  # noqa: E402
from sglx.attention.kernels.store_kv import store_kv  # noqa: E402
from triton_interpreted.paged import make_paged_cache, reference_attention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def _indices(cache, lens):
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    kv_indices = torch.full((sum(lens),), -1, dtype=torch.int32)
    build_kv_indices(cache.r2t.req_to_token, torch.tensor(cache.rows), kv_indptr, kv_indices)
    return kv_indptr, kv_indices


def test_kv_indices_follow_req_to_token_rows():
    lens = [1, 40, 7, 600]  # 600 > the kernel's block: several loop trips
    cache = make_paged_cache(lens, 16, 1, 16, torch.float32, fill=[0, 0, 0, 0])
    kv_indptr, kv_indices = _indices(cache, lens)
    assert kv_indptr.tolist() == [0, 1, 41, 48, 648]
    expected = torch.cat([cache.slots(i, 0, n) for i, n in enumerate(lens)]).int()
    assert torch.equal(kv_indices, expected)


def test_one_launch_kv_metadata_equals_indptr_plus_indices():
    lens = [1, 40, 7, 600]  # in request order, not sorted: each program sums only the lengths before it
    cache = make_paged_cache(lens, 16, 1, 16, torch.float32, fill=[0, 0, 0, 0])
    kv_indptr = torch.full((len(lens) + 1,), -1, dtype=torch.int32)
    kv_indices = torch.full((sum(lens) + 5,), -1, dtype=torch.int32)
    build_kv_metadata(cache.r2t.req_to_token, torch.tensor(cache.rows), torch.tensor(lens), kv_indptr, kv_indices)
    assert kv_indptr.tolist() == [0, 1, 41, 48, 648]
    expected = torch.cat([cache.slots(i, 0, n) for i, n in enumerate(lens)]).int()
    assert torch.equal(kv_indices[:648], expected) and kv_indices[648:].eq(-1).all()


@pytest.mark.parametrize("kv_cache_dtype,scales", [("auto", (1.0, 1.0)), ("fp8_e4m3", (0.37, 1.9)),
                                                   ("fp8_e5m2", (1.0, 0.05))])
def test_store_kv_writes_the_same_bits_as_the_pool(kv_cache_dtype, scales):
    lens = [5, 19]
    mine = make_paged_cache(lens, 4, 3, 80, torch.float32, kv_cache_dtype=kv_cache_dtype, scales=scales,
                            fill=[0, 0])
    theirs = make_paged_cache(lens, 4, 3, 80, torch.float32, kv_cache_dtype=kv_cache_dtype, scales=scales,
                              fill=[0, 0])
    loc = torch.cat([mine.slots(i, 0, n) for i, n in enumerate(lens)])
    k = torch.cat(mine.raw_keys) * 40  # reach the saturating end of e4m3 too
    v = torch.cat(mine.raw_values)
    k.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    pool = mine.pool
    store_kv(k, v, pool.k_buffer[0], pool.v_buffer[0], loc, *scales, pool.fp8_dtype)
    theirs.pool.set_kv(0, loc, k, v)
    assert torch.equal(pool.k_buffer[0].view(torch.uint8), theirs.pool.k_buffer[0].view(torch.uint8))
    assert torch.equal(pool.v_buffer[0].view(torch.uint8), theirs.pool.v_buffer[0].view(torch.uint8))


def test_fp8_encoding_rounds_ties_to_even_at_every_binade():
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        table = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        finite = table[torch.isfinite(table)].unique()
        mids = (finite[1:] + finite[:-1]) / 2
        x = torch.cat([finite, mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1])])
        x = torch.cat([x, torch.zeros((-x.numel()) % 128)]).view(-1, 2, 64)
        buf = torch.zeros(x.shape, dtype=torch.uint8)
        store_kv(x, x, buf, buf.clone(), torch.arange(x.shape[0]), fp8_dtype=fp8)
        assert torch.equal(buf, x.to(fp8).view(torch.uint8)), fp8


def test_num_kv_splits_fill_the_gpu_but_keep_splits_long():
    assert choose_num_kv_splits(1, 8, 4096, 132, DecodeConfig(min_chunk=256)) == 16  # limited by min_chunk
    assert choose_num_kv_splits(1, 8, 1024, 132) == 16  # default min_chunk: 64 keys (one tile)
    # 512 rows = 3.9 per SM: one split, no merge (the H100 sweeps); without that rule, 2 (4 waves)
    assert choose_num_kv_splits(64, 8, 4096, 132) == 1
    assert choose_num_kv_splits(64, 8, 4096, 132, DecodeConfig(one_split_rows_per_sm=0)) == 2
    assert choose_num_kv_splits(64, 8, 4096, 132, DecodeConfig(one_split_rows_per_sm=4.0)) == 2
    assert choose_num_kv_splits(24, 8, 4096, 132) == 1  # 1.45 per SM
    assert choose_num_kv_splits(16, 8, 4096, 132) == 5  # 0.97 per SM: splits fill 4 waves
    assert choose_num_kv_splits(256, 8, 4096, 132) == 1
    assert choose_num_kv_splits(1, 1, 10**6, 132) == 64  # capped
    assert choose_num_kv_splits(4, 8, 100, 132) == 2
    assert choose_num_kv_splits(4, 8, 64, 132) == 1


DECODE_CASES = [
    # (page, hq, hkv, dim, dtype, kv_cache_dtype, scales, window, cap, max_splits)
    (1, 4, 4, 64, torch.float32, "auto", (1.0, 1.0), None, 0.0, 4),
    (16, 8, 2, 80, torch.float32, "auto", (1.0, 1.0), 24, 0.0, 3),
    (16, 4, 1, 96, torch.float32, "auto", (1.0, 1.0), None, 8.0, 4),
    (1, 4, 2, 128, torch.float16, "auto", (1.0, 1.0), None, 0.0, 2),
    (16, 4, 2, 64, torch.float32, "fp8_e4m3", (0.5, 2.0), None, 0.0, 4),
    (1, 6, 2, 64, torch.float16, "fp8_e5m2", (1.0, 0.7), 10, 6.0, 4),
    (16, 2, 1, 256, torch.float32, "auto", (1.0, 1.0), None, 0.0, 2),
    # one split: stage 1 writes the output itself, with or without semaphores
    (16, 8, 2, 64, torch.float32, "auto", (1.0, 1.0), None, 0.0, 1),
    (1, 4, 2, 64, torch.float16, "fp8_e4m3", (0.5, 2.0), 20, 5.0, 1),
]


def test_one_split_writes_the_output_without_scratch_or_a_second_kernel():
    """max_splits 1: the partials scratch stays untouched (NaN) and no semaphore is needed."""
    lens = [5, 40]
    cache = make_paged_cache(lens, 1, 2, 64, torch.float32, seed=9)
    kv_indptr, kv_indices = _indices(cache, lens)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    out = torch.full((2, 4, 64), float("nan"))
    mid_o = torch.full((2, 4, 1, 64), float("nan"))
    mid_lse = torch.full((2, 4, 1), float("nan"))
    decode_attention(q, cache.pool.k_buffer[0], cache.pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                     0.125, config=DecodeConfig(min_chunk=16), interpret=True)
    assert mid_o.isnan().all() and mid_lse.isnan().all()
    for i, n in enumerate(lens):
        ref = reference_attention(q[i:i + 1], cache.keys[i], cache.values[i], torch.tensor([n - 1]), 0.125, None, 0.0)
        assert (out[i:i + 1].double() - ref).abs().max().item() <= TOL[torch.float32]


def _poison_page_tails(cache, lens: list[int], page: int) -> None:
    """NaN (float pools) / 0x7F (fp8 bits: NaN in e4m3) in the slots of each request's last page past its length:
    a TMA tile reads them, and they must not reach the output."""
    pool = cache.pool
    for row, n in zip(cache.rows, lens):
        last = int(cache.r2t.req_to_token[row, n - 1])
        tail = list(range(last + 1, (last // page + 1) * page))
        for buf in (pool.k_buffer[0], pool.v_buffer[0]):
            buf[tail] = 0x7F if buf.dtype == torch.uint8 else float("nan")


@pytest.mark.parametrize("tma,prefetch", [(False, False), (True, False), (False, True)],
                         ids=["loads", "tma", "slots-a-tile-ahead"])
@pytest.mark.parametrize("merge", ["second-kernel", "last-split"])
@pytest.mark.parametrize("page,hq,hkv,dim,dtype,kv_cache_dtype,scales,window,cap,max_splits", DECODE_CASES)
def test_decode_matches_float64(page, hq, hkv, dim, dtype, kv_cache_dtype, scales, window, cap, max_splits, merge,
                                tma, prefetch):
    lens = [1, 70, 33]  # a one-token request, one that needs every split, one in between
    cache = make_paged_cache(lens, page, hkv, dim, dtype, kv_cache_dtype=kv_cache_dtype, scales=scales, seed=dim)
    if tma:  # TMA applies to pages of whole 16-key tiles without a window: the others check the fallback
        _poison_page_tails(cache, lens, page)
    kv_indptr, kv_indices = _indices(cache, lens)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full((len(lens), hq, dim), float("nan"), dtype=dtype)
    mid_o = torch.empty(len(lens), hq, max_splits, dim)
    mid_lse = torch.empty(len(lens), hq, max_splits)
    sems = torch.zeros(semaphore_count(len(lens), hq, hkv), dtype=torch.int32) if merge == "last-split" else None
    pool = cache.pool
    decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                     dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=scales[0], v_scale=scales[1],
                     fp8_dtype=pool.fp8_dtype, config=DecodeConfig(min_chunk=16, tma=tma, prefetch_slots=prefetch),
                     interpret=True, semaphores=sems, page_size=page)
    if sems is not None:
        assert sems.eq(0).all()  # every launch leaves them ready for the next (graph replays rely on it)
    for i, n in enumerate(lens):
        ref = reference_attention(q[i:i + 1], cache.keys[i], cache.values[i], torch.tensor([n - 1]), dim ** -0.5,
                                  window, cap)
        err = (out[i:i + 1].double() - ref).abs().max().item()
        assert err <= TOL[dtype], (i, err)


EXTEND_CASES = [
    # (page, hq, hkv, dim, dtype, kv_cache_dtype, scales, window, cap)
    (1, 4, 2, 64, torch.float32, "auto", (1.0, 1.0), None, 0.0),
    (16, 4, 4, 80, torch.float32, "auto", (1.0, 1.0), 13, 0.0),
    (16, 6, 2, 64, torch.float32, "auto", (1.0, 1.0), None, 5.0),
    (1, 4, 1, 96, torch.float16, "auto", (1.0, 1.0), 40, 0.0),
    (16, 4, 2, 64, torch.float32, "fp8_e4m3", (0.6, 1.7), 21, 0.0),
    (1, 2, 1, 128, torch.float16, "fp8_e5m2", (1.0, 1.0), None, 4.0),
    (16, 2, 1, 192, torch.float32, "auto", (1.0, 1.0), 9, 0.0),  # 128 + 64: two tiles (head_split)
    (1, 2, 2, 160, torch.float16, "fp8_e5m2", (1.0, 1.0), None, 0.0),  # 128 + 32 over an fp8 pool
]


@pytest.mark.parametrize("ext,tma,section,prefetch", [
    (False, False, 0, None), (False, False, 0, False), (True, False, 0, None), (True, True, 0, None),
    (True, True, 3, True)],
    ids=["pool-only", "pool-only-ids-in-loop", "new-rows-from-ext", "new-rows-through-tma", "tma-in-head-sections"])
@pytest.mark.parametrize("page,hq,hkv,dim,dtype,kv_cache_dtype,scales,window,cap", EXTEND_CASES)
def test_extend_over_cached_prefix_matches_float64(page, hq, hkv, dim, dtype, kv_cache_dtype, scales, window, cap,
                                                   ext, tma, section, prefetch):
    """section 3: programs ordered 3 (request, head) pairs at a time, the last section short (ExtendConfig.section).
    prefetch: the unmasked pool loop's slot ids a tile ahead (None: the default, on for pool-only launches here)."""
    prefix, new = [0, 21, 50, 3], [37, 1, 20, 0]  # no prefix, a decode-like row, both, an empty row
    lens = [p + n for p, n in zip(prefix, new)]
    cache = make_paged_cache(lens, page, hkv, dim, dtype, kv_cache_dtype=kv_cache_dtype, scales=scales,
                             fill=prefix, seed=dim + 1)
    pool = cache.pool
    k_new, v_new = cache.store_new(prefix, scales)
    kv_indptr, kv_indices = _indices(cache, lens)
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32))
    q = torch.randn(sum(new), hq, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.full((sum(new), hq, dim), float("nan"), dtype=dtype)
    extend_attention(q, pool.k_buffer[0], pool.v_buffer[0], out, qo_indptr, kv_indptr, kv_indices, max(new),
                     dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=scales[0], v_scale=scales[1],
                     fp8_dtype=pool.fp8_dtype, interpret=True,
                     config=ExtendConfig(tma=tma, section=section, prefetch_slots=prefetch),
                     k_ext=k_new.to(dtype) if ext else None, v_ext=v_new.to(dtype) if ext else None)
    row = 0
    for i, (p, n) in enumerate(zip(prefix, new)):
        ref = reference_attention(q[row:row + n], cache.keys[i], cache.values[i], torch.arange(p, p + n),
                                  dim ** -0.5, window, cap)
        err = (out[row:row + n].double() - ref).abs().max().item() if n else 0.0
        assert err <= TOL[dtype], (i, err)
        row += n


@pytest.mark.parametrize("split", [None, False], ids=["split-head", "padded-head"])
def test_extend_at_mla_expanded_head_dims_matches_float64(split):
    """MLA's expanded heads as triton MLA runs them: q/k 192 wide (128 + 64: two tiles, or one padded to 256), values
    128, every key gathered from expanded rows through kv_indices, causal over cached prefixes."""
    from sglx.attention.kernels.extend_attention import head_split

    assert head_split(192) == (128, 64) and head_split(160) == (128, 32) and head_split(96) == (128, 0)
    assert head_split(128) == (128, 0) and head_split(256) == (256, 0) and head_split(200) == (256, 0)
    gen = torch.Generator().manual_seed(5)
    heads, dqk, dv = 2, 192, 128
    prefix, new = [0, 30, 5], [20, 1, 17]
    lens = [p + n for p, n in zip(prefix, new)]
    keys = torch.randn(sum(lens), heads, dqk, generator=gen)
    values = torch.randn(sum(lens), heads, dv, generator=gen)
    q = torch.randn(sum(new), heads, dqk, generator=gen)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32))
    out = torch.full((sum(new), heads, dv), float("nan"))
    extend_attention(q, keys, values, out, qo_indptr, kv_indptr, torch.arange(sum(lens), dtype=torch.int32),
                     max(new), 0.07, interpret=True, config=ExtendConfig(split_head=split))
    row = 0
    for i, (p, n) in enumerate(zip(prefix, new)):
        k, v = keys[kv_indptr[i]:kv_indptr[i + 1]].double(), values[kv_indptr[i]:kv_indptr[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", q[row:row + n].double(), k) * 0.07
        visible = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v)
        assert (out[row:row + n].double() - ref).abs().max().item() <= TOL[torch.float32], i
        row += n


@pytest.mark.parametrize("tma", [False, True], ids=["loads", "tma"])
def test_extend_reads_new_tiles_from_ext_rows(tma):
    """The ext path is really taken: poisoned ext rows change a no-prefix request, not a prefix-only tile."""
    prefix, new = [0, 20], [40, 3]
    lens = [p + n for p, n in zip(prefix, new)]
    cache = make_paged_cache(lens, 1, 1, 64, torch.float32, fill=lens, seed=3)
    kv_indptr, kv_indices = _indices(cache, lens)
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32))
    q = torch.randn(sum(new), 2, 64, generator=torch.Generator().manual_seed(4))
    k_new = torch.cat([k[p:] for k, p in zip(cache.raw_keys, prefix)])
    v_new = torch.cat([v[p:] for v, p in zip(cache.raw_values, prefix)])
    runs = []
    for k_ext in (k_new, torch.zeros_like(k_new)):
        out = torch.empty(sum(new), 2, 64)
        extend_attention(q, cache.pool.k_buffer[0], cache.pool.v_buffer[0], out, qo_indptr, kv_indptr, kv_indices,
                         max(new), 0.125, interpret=True, k_ext=k_ext, v_ext=v_new, config=ExtendConfig(tma=tma))
        runs.append(out)
    assert not torch.allclose(runs[0][:40], runs[1][:40])  # request 0: every key tile is this step's
    # request 1's three new keys share a tile with its prefix (20 is not a multiple of 16): read from the pool
    assert torch.equal(runs[0][40:], runs[1][40:])
