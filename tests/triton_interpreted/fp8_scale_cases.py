"""fp8 KV with per-token scales and rotated keys: the Triton store, decode and extend kernels, interpreted.

Run only under TRITON_INTERPRET=1 (tests/test_fp8_kv_scales.py launches this). The attention references
are float64 over what the pool holds: the same stored bytes times the same per-slot scales, in the
pool's rotated key basis with the same rotated queries the kernels get; `TokenKVPool.get_kv` (which
undoes the rotation) is checked against the unrotated queries separately.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_fp8_kv_scales.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.attention.kernels.decode_attention import DecodeConfig, decode_attention, semaphore_count  # noqa: E402
from sglx.attention.kernels.extend_attention import extend_attention  # noqa: E402
from sglx.attention.kernels.kv_indices import build_kv_indptr  # noqa: E402
from sglx.attention.kernels.store_kv import store_kv, store_kv_to_pool  # noqa: E402
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool  # noqa: E402
from triton_interpreted.paged import reference_attention, step_batch  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


class Cache:
    """Requests on shuffled pages of a one-layer per-token-scale pool (filled by `TokenKVPool.set_kv`; the
    store kernel writes the same bytes up to near-ties, test_store_kernel_quantizes_like_the_pool)."""

    def __init__(self, lens: list[int], page: int, hkv: int, dim: int, dtype: torch.dtype, kv_cache_dtype: str,
                 seed: int, fill: list[int] | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-n // page) for n in lens]
        num_slots = (sum(pages) + 2) * page
        self.r2t = ReqToTokenPool(len(lens) + 1, max(lens) + page)
        self.pool = TokenKVPool(num_slots, page, 1, hkv, dim, dtype, kv_cache_dtype=kv_cache_dtype,
                                per_token_scales=True)
        free = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()
        self.rows, self.raw_k, self.raw_v = [], [], []
        for i, n in enumerate(lens):
            row = self.r2t.alloc()
            mine = [free.pop() for _ in range(pages[i])]
            self.r2t.req_to_token[row, :n] = torch.tensor([p * page + j for p in mine for j in range(page)][:n])
            # keys with a few large channels and varied token norms (what per-token scales are for)
            k = torch.randn(n, hkv, dim, generator=gen) * (0.1 + 3 * torch.rand(n, 1, 1, generator=gen))
            k[..., :3] *= 12
            self.rows.append(row)
            self.raw_k.append(k.to(dtype))
            self.raw_v.append(torch.randn(n, hkv, dim, generator=gen).to(dtype))
            stored = n if fill is None else fill[i]
            if stored:
                self.pool.set_kv(0, self.slots(i, 0, stored), self.raw_k[i][:stored], self.raw_v[i][:stored])

    def slots(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.r2t.req_to_token[self.rows[i], lo:hi].long()

    def held(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 (rotated K, V) of request i's first n tokens: stored bits times their slots' scales."""
        pool, slots = self.pool, self.slots(i, 0, n)
        k = pool.k_buffer[0][slots].view(pool.fp8_dtype).double() * pool.k_scale[0][slots][..., None].double()
        v = pool.v_buffer[0][slots].view(pool.fp8_dtype).double() * pool.v_scale[0][slots][..., None].double()
        return k, v

    def indices(self, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
        kv_indices = torch.cat([self.slots(i, 0, n) for i, n in enumerate(lens)]).int()
        return kv_indptr, kv_indices


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_store_kernel_quantizes_like_the_pool(kv_cache_dtype):
    """Same rotation, base scale and candidate search as TokenKVPool.set_kv: the kernel's per-row rounding
    error is never worse than the pool's (near-ties may pick another candidate), and most bytes agree."""
    n, hkv, dim = 12, 3, 80
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(n, hkv, dim, generator=gen) * (0.01 + 4 * torch.rand(n, 1, 1, generator=gen))
    k[..., 7] *= 30
    v = torch.randn(n, hkv, dim, generator=gen)
    v[3] = 0.0  # an all-zero row: finite scale, zero bits
    mine = TokenKVPool(n + 4, 4, 1, hkv, dim, torch.float32, kv_cache_dtype, per_token_scales=True)
    theirs = TokenKVPool(n + 4, 4, 1, hkv, dim, torch.float32, kv_cache_dtype, per_token_scales=True)
    loc = torch.randperm(n, generator=gen) + 4
    store_kv_to_pool(mine, 0, k, v, loc)
    theirs.set_kv(0, loc, k, v)
    rot = (k.double() @ mine.k_rotation.double())

    def row_error(pool: TokenKVPool) -> torch.Tensor:
        held = pool.k_buffer[0][loc].view(pool.fp8_dtype).double() * pool.k_scale[0][loc][..., None]
        return ((held - rot) ** 2).sum(-1)

    assert (row_error(mine) <= row_error(theirs) * (1 + 1e-4) + 1e-12).all()
    same = (mine.k_buffer[0][loc] == theirs.k_buffer[0][loc]).float().mean().item()
    assert same > 0.97, same
    assert torch.equal(mine.v_buffer[0][loc], theirs.v_buffer[0][loc])  # V: amax scale only, no search
    assert torch.equal(mine.v_scale[0][loc], theirs.v_scale[0][loc])
    assert torch.isfinite(mine.v_scale[0][loc]).all() and mine.v_buffer[0][loc[3]].eq(0).all()
    # the stored K, rotated back, is k up to fp8 rounding (relative to each row's largest channel)
    back, _ = mine.get_kv(0, loc, torch.float64)
    rel = ((back - k.double()).abs().amax(-1) / k.double().abs().amax(-1)).max().item()
    assert rel < (0.05 if kv_cache_dtype == "fp8_e4m3" else 0.1), rel
    with pytest.raises(TypeError, match="store_kv_to_pool"):
        store_kv(k, v, mine.k_buffer[0], mine.v_buffer[0], loc, mine.k_scale[0], mine.v_scale[0], mine.fp8_dtype)


def test_store_path_writes_a_calibrated_rotated_static_pool_like_the_pool():
    """--kv-cache-scales calibrate through the shared store path (kv_store.store_step_kv with the Triton kernel, as
    on a GPU): the first prefill freezes the same per-layer scales as TokenKVPool.set_kv, the bytes agree."""
    from types import SimpleNamespace

    from sglx.attention.llm.base import LayerSpec
    from sglx.attention.llm.kv_store import store_step_kv
    from sglx.llm.forward_batch import ForwardMode

    n, hkv, dim = 10, 2, 64
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(n, hkv, dim, generator=gen) * (0.05 + 3 * torch.rand(n, 1, 1, generator=gen))
    k[..., 4] *= 25
    v = torch.randn(n, hkv, dim, generator=gen)
    pools = [TokenKVPool(2 * n + 4, 4, 1, hkv, dim, torch.float32, "fp8_e4m3") for _ in range(2)]
    for pool in pools:
        pool.calibrate_static_scales(rotate_keys=True)
    loc = torch.randperm(n, generator=gen) + 4
    layer = LayerSpec(0, 4, hkv, dim, dim ** -0.5)
    batch = SimpleNamespace(mode=ForwardMode.EXTEND, token_kv_pool=pools[0], out_cache_loc=loc)
    store_step_kv(k, v, layer, batch, kernel_on_cpu=True)
    pools[1].set_kv(0, loc, k, v)
    assert not pools[0].calibrating and pools[0].k_scale == pools[1].k_scale and pools[0].v_scale == pools[1].v_scale
    same = (pools[0].k_buffer[0][loc] == pools[1].k_buffer[0][loc]).float().mean().item()
    assert same > 0.99, same  # the kernel and torch round the same float32 values (rare matmul near-ties)
    assert torch.equal(pools[0].v_buffer[0][loc], pools[1].v_buffer[0][loc])
    back, _ = pools[0].get_kv(0, loc, torch.float64)
    rel = ((back - k.double()).norm(dim=-1) / k.double().norm(dim=-1)).max().item()
    assert rel < 0.04, rel
    # a decode step afterwards stores with the frozen scales
    batch = SimpleNamespace(mode=ForwardMode.DECODE, token_kv_pool=pools[0], out_cache_loc=loc[:2] + n)
    store_step_kv(k[:2] * 2, v[:2], layer, batch, kernel_on_cpu=True)
    assert pools[0].k_scale == pools[1].k_scale


def test_store_path_keeps_a_skipped_layer_in_the_model_dtype():
    """--kv-cache-dtype-skip-layers 1 through the Triton store kernel: layer 1 holds the (rotated) keys and the
    values in the model dtype, unrounded, layer 0 fp8 bits with its calibrated scales, as TokenKVPool.set_kv."""
    from types import SimpleNamespace

    from sglx.attention.llm.base import LayerSpec
    from sglx.attention.llm.kv_store import store_step_kv
    from sglx.llm.forward_batch import ForwardMode

    n, hkv, dim = 6, 2, 64
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(n, hkv, dim, generator=gen) * 4, torch.randn(n, hkv, dim, generator=gen)
    pools = [TokenKVPool(2 * n + 4, 4, 2, hkv, dim, torch.float16, "fp8_e4m3") for _ in range(2)]
    for pool in pools:
        pool.calibrate_static_scales(rotate_keys=True)
        pool.keep_unquantized((1,))
    loc = torch.randperm(n, generator=gen) + 4
    for layer_id in (0, 1):
        batch = SimpleNamespace(mode=ForwardMode.EXTEND, token_kv_pool=pools[0], out_cache_loc=loc)
        store_step_kv(k.half(), v.half(), LayerSpec(layer_id, 4, hkv, dim, dim ** -0.5), batch, kernel_on_cpu=True)
        pools[1].set_kv(layer_id, loc, k.half(), v.half())
    assert pools[0].k_buffer[1].dtype == torch.float16 and pools[0].k_buffer[0].dtype == torch.uint8
    assert pools[0].k_scale[1] == 1.0 and pools[0].k_scale[0] != 1.0 and not pools[0].calibrating
    assert torch.allclose(pools[0].k_buffer[1][loc].float(), pools[1].k_buffer[1][loc].float(), atol=2e-3)
    assert torch.equal(pools[0].v_buffer[1][loc], v.half())
    back, _ = pools[0].get_kv(1, loc, torch.float64)
    assert torch.allclose(back, k.half().double(), atol=1e-2)  # fp16 rounding of the rotated keys only
    same = (pools[0].k_buffer[0][loc] == pools[1].k_buffer[0][loc]).float().mean().item()
    assert same > 0.99, same


DECODE_CASES = [
    # (page, hq, hkv, dim, dtype, kv_cache_dtype, window, cap, max_splits, merge)
    (16, 4, 2, 64, torch.float32, "fp8_e4m3", None, 0.0, 4, "last-split"),
    (1, 6, 2, 80, torch.float16, "fp8_e5m2", 10, 6.0, 3, "second-kernel"),
    (16, 8, 1, 128, torch.float16, "fp8_e4m3", None, 0.0, 2, "last-split"),
]


@pytest.mark.parametrize("prefetch", [False, True], ids=["slots-in-step", "slots-a-tile-ahead"])
@pytest.mark.parametrize("fold", ["tile_max", "exponent"])
@pytest.mark.parametrize("page,hq,hkv,dim,dtype,kv_cache_dtype,window,cap,max_splits,merge", DECODE_CASES)
def test_decode_with_per_token_scales_matches_float64(page, hq, hkv, dim, dtype, kv_cache_dtype, window, cap,
                                                      max_splits, merge, fold, prefetch):
    lens = [1, 50, 23]
    cache = Cache(lens, page, hkv, dim, dtype, kv_cache_dtype, seed=dim)
    kv_indptr, kv_indices = cache.indices(lens)
    q = torch.randn(len(lens), hq, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    q_rot = cache.pool.rotate_query(q)
    out = torch.full((len(lens), hq, dim), float("nan"), dtype=dtype)
    mid_o = torch.empty(len(lens), hq, max_splits, dim)
    mid_lse = torch.empty(len(lens), hq, max_splits)
    sems = torch.zeros(semaphore_count(len(lens), hq, hkv), dtype=torch.int32) if merge == "last-split" else None
    pool = cache.pool
    decode_attention(q_rot, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                     dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=pool.k_scale[0],
                     v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype,
                     config=DecodeConfig(min_chunk=16, token_scale_fold=fold, prefetch_slots=prefetch), interpret=True,
                     semaphores=sems)
    for i, n in enumerate(lens):
        k, v = cache.held(i, n)
        ref = reference_attention(q_rot[i:i + 1], k, v, torch.tensor([n - 1]), dim ** -0.5, window, cap)
        err = (out[i:i + 1].double() - ref).abs().max().item()
        assert err <= TOL[dtype], (i, err)
        # get_kv undoes the rotation: the unrotated query over it gives the same attention
        k_plain, v_plain = pool.get_kv(0, cache.slots(i, 0, n), torch.float64)
        plain = reference_attention(q[i:i + 1], k_plain, v_plain, torch.tensor([n - 1]), dim ** -0.5, window, cap)
        assert (plain - ref).abs().max().item() <= 10 * TOL[dtype]


@pytest.mark.parametrize("prefetch", [False, True], ids=["slots-in-step", "slots-a-tile-ahead"])
def test_decode_exponent_fold_with_scales_far_apart_and_garbage_in_unused_slots(prefetch):
    """fp16 weights with V scales spread over 2^-24 .. 2^1 inside one request (a tile's scales up to 2^25 apart,
    more than fp16's normal range spans) and NaN/inf/0/negative scales in the reserved slots that masked lanes
    read (the "exponent" fold loads scales unmasked): float64 over the stored bytes, at fp16 output rounding.
    Each row's weights are normalised by that row's largest p * scale. ("tile_max" divides by the tile's
    largest scale instead, so rows whose likely keys have small scales get subnormal fp16 weights: 1.1e-2 and
    1.7e-1 relative error on two of these rows; realistic spreads are far smaller, the regular cases cover it.)"""
    fold = "exponent"
    page, hq, hkv, dim, lens = 4, 8, 2, 64, [37, 9, 64]
    cache = Cache(lens, page, hkv, dim, torch.float16, "fp8_e4m3", seed=17)
    pool = cache.pool
    gen = torch.Generator().manual_seed(4)
    for i, n in enumerate(lens):  # stored V = bits * scale; scale the scales (the bits stay): values far apart
        slots = cache.slots(i, 0, n)
        exps = torch.randint(-24, 1, (n, hkv), generator=gen).float()
        exps[0] = -24.0  # MIN_SCALE itself
        pool.v_scale[0][slots] = torch.exp2(exps) * (1 + torch.rand(n, hkv, generator=gen))
    pool.v_scale[0][:page] = torch.tensor([float("nan"), float("inf"), 0.0, -3.0])[:, None]
    pool.k_scale[0][:page] = torch.tensor([float("inf"), float("nan"), 0.0, -1.0])[:, None]
    kv_indptr, kv_indices = cache.indices(lens)
    q_rot = pool.rotate_query(torch.randn(len(lens), hq, dim, generator=gen).half())
    out = torch.full((len(lens), hq, dim), float("nan"), dtype=torch.float16)
    max_splits = 3
    mid_o = torch.empty(len(lens), hq, max_splits, dim)
    mid_lse = torch.empty(len(lens), hq, max_splits)
    decode_attention(q_rot, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse,
                     dim ** -0.5, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype,
                     config=DecodeConfig(min_chunk=16, token_scale_fold=fold, prefetch_slots=prefetch), interpret=True)
    for i, n in enumerate(lens):
        k, v = cache.held(i, n)
        ref = reference_attention(q_rot[i:i + 1], k, v, torch.tensor([n - 1]), dim ** -0.5)
        # relative to the row's size: the output mixes values 2^25 apart
        err = ((out[i:i + 1].double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert err <= 1.5e-3, (i, err)


def test_decode_rejects_an_unknown_scale_fold_and_scales_of_two_layouts():
    with pytest.raises(ValueError, match="token_scale_fold 'tile': choose one of tile_max, exponent"):
        DecodeConfig(token_scale_fold="tile")
    cache = Cache([5], 4, 2, 64, torch.float32, "fp8_e4m3", seed=1)
    pool = cache.pool
    kv_indptr, kv_indices = cache.indices([5])
    with pytest.raises(ValueError, match="one row-major layout"):
        decode_attention(torch.zeros(1, 2, 64), pool.k_buffer[0], pool.v_buffer[0], torch.empty(1, 2, 64), kv_indptr,
                         kv_indices, torch.empty(1, 2, 2, 64), torch.empty(1, 2, 2), 0.125, k_scale=pool.k_scale[0],
                         v_scale=pool.v_scale[0].t().contiguous().t(), fp8_dtype=pool.fp8_dtype, interpret=True)


EXTEND_CASES = [
    # (page, hq, hkv, dim, dtype, kv_cache_dtype, window, cap)
    (16, 4, 2, 64, torch.float32, "fp8_e4m3", 21, 0.0),
    (1, 2, 1, 96, torch.float16, "fp8_e5m2", None, 4.0),
]


@pytest.mark.parametrize("page,hq,hkv,dim,dtype,kv_cache_dtype,window,cap", EXTEND_CASES)
def test_extend_with_per_token_scales_matches_float64(page, hq, hkv, dim, dtype, kv_cache_dtype, window, cap):
    prefix, new = [0, 21, 18, 3], [19, 1, 9, 0]
    lens = [p + n for p, n in zip(prefix, new)]
    cache = Cache(lens, page, hkv, dim, dtype, kv_cache_dtype, seed=dim + 1, fill=prefix)
    pool = cache.pool
    loc = torch.cat([cache.slots(i, p, p + n) for i, (p, n) in enumerate(zip(prefix, new))])
    k_new = torch.cat([k[p:] for k, p in zip(cache.raw_k, prefix)])
    v_new = torch.cat([v[p:] for v, p in zip(cache.raw_v, prefix)])
    pool.set_kv(0, loc, k_new, v_new)  # as the prefix: the store kernel is checked on its own above
    kv_indptr, kv_indices = cache.indices(lens)
    qo_indptr = build_kv_indptr(torch.tensor(new, dtype=torch.int32))
    q_rot = pool.rotate_query(torch.randn(sum(new), hq, dim, generator=torch.Generator().manual_seed(2)).to(dtype))
    out = torch.full((sum(new), hq, dim), float("nan"), dtype=dtype)
    extend_attention(q_rot, pool.k_buffer[0], pool.v_buffer[0], out, qo_indptr, kv_indptr, kv_indices, max(new),
                     dim ** -0.5, sliding_window=window, logit_cap=cap, k_scale=pool.k_scale[0],
                     v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype, interpret=True, k_ext=k_new, v_ext=v_new)
    row = 0
    for i, (p, n) in enumerate(zip(prefix, new)):
        if n:
            k, v = cache.held(i, p + n)
            ref = reference_attention(q_rot[row:row + n], k, v, torch.arange(p, p + n), dim ** -0.5, window, cap)
            err = (out[row:row + n].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (i, err)
        row += n


def test_triton_backend_with_per_token_pool_equals_float64_through_every_step():
    """TritonBackend end to end (store kernel, query rotation, extend/mixed/decode kernels) on a per-token pool,
    next to TorchNativeBackend on its own pool: each matches float64 over the bytes its pool holds."""
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.attention.llm.triton import TritonBackend
    from sglx.llm.forward_batch import ForwardMode

    hq, hkv, dim, page = 4, 2, 64, 16
    prefix = [0, 5, 17]
    steps = [(ForwardMode.EXTEND, [9, 3, 1]), (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.MIXED, [1, 2, 1])]
    total = [p + sum(s[1][i] for s in steps) for i, p in enumerate(prefix)]
    caches = [Cache(total, page, hkv, dim, torch.float32, "fp8_e4m3", seed=9, fill=prefix) for _ in range(2)]
    backends = [cls(BackendContext(torch.device("cpu"), torch.float32, hq, hkv, dim, page, c.r2t, c.pool))
                for cls, c in zip((TritonBackend, TorchNativeBackend), caches)]
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5)
    gen = torch.Generator().manual_seed(3)
    lo = list(prefix)
    for mode, new in steps:
        hi = [a + n for a, n in zip(lo, new)]
        q = torch.randn(sum(new), hq, dim, generator=gen)
        outs = []
        for cache, backend in zip(caches, backends):
            batch = step_batch(cache, mode, lo, new)
            k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_k, lo, hi)])
            v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_v, lo, hi)])
            backend.init_forward_metadata(batch)
            out = backend.forward(q, k, v, layer, batch)
            row = 0
            for i, (a, n) in enumerate(zip(lo, new)):
                keys, values = cache.pool.get_kv(0, cache.slots(i, 0, a + n), torch.float64)
                ref = reference_attention(q[row:row + n], keys, values, torch.arange(a, a + n), layer.scaling)
                assert (out[row:row + n].double() - ref).abs().max().item() <= 1e-4, (mode, i)
                row += n
            outs.append(out)
        assert (outs[0] - outs[1]).abs().max().item() <= 0.05, mode  # different writers: near-ties may differ
        lo = hi
    same = (caches[0].pool.k_buffer[0] == caches[1].pool.k_buffer[0]).float().mean().item()
    assert same > 0.97, same
