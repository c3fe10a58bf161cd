"""MLA Triton kernels and the triton MLA backend vs float64, run only under TRITON_INTERPRET=1.

tests/test_triton_mla.py launches this module in a child pytest. Latents live on shuffled pages; the
decode kernel runs several splits and head blocks (heads not a multiple of the block, latent widths not
powers of two); the backend replays extend (cached prefixes), decode and mixed steps next to torch_native.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_triton_mla.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr  # noqa: E402
from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention  # noqa: E402
from sglx.attention.llm.base import BackendContext  # noqa: E402
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections, absorb_q, apply_uv  # noqa: E402
from sglx.attention.llm.mla_reference import reference_mla  # noqa: E402
from sglx.attention.llm.torch_native_mla import TorchNativeMLABackend  # noqa: E402
from sglx.attention.llm.triton_mla import TritonMLABackend  # noqa: E402
from sglx.llm.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglx.llm.kv_cache import ReqToTokenPool  # noqa: E402
from sglx.llm.mla_kv_cache import MLATokenKVPool  # noqa: E402


class Latents:
    """Requests' latents on shuffled pages of a one-layer MLA pool."""

    def __init__(self, lens, page, r, dr, dtype, kv_cache_dtype="auto", seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.r, self.dr = gen, r, dr
        num_slots = (sum(-(-n // page) for n in lens) + 2) * page
        self.r2t = ReqToTokenPool(len(lens) + 1, max(lens) + page)
        self.pool = MLATokenKVPool(num_slots, page, 1, r, dr, dtype, kv_cache_dtype)
        pages = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()
        self.rows = []
        self.latents = []
        for n in lens:
            row = self.r2t.alloc()
            mine = [pages.pop() for _ in range(-(-n // page))]
            self.r2t.req_to_token[row, :n] = torch.tensor([p * page + j for p in mine for j in range(page)][:n],
                                                          dtype=torch.int32)
            self.rows.append(row)
            self.latents.append(torch.randn(n, r + dr, generator=gen).to(dtype))

    def slots(self, i, lo, hi):
        return self.r2t.req_to_token[self.rows[i], lo:hi].long()

    def store(self, i, lo, hi):
        lat = self.latents[i][lo:hi]
        self.pool.set_latent(0, self.slots(i, lo, hi), lat[:, :self.r], lat[:, self.r:])

    def stored(self, i, n):
        return self.pool.get_latent(0, self.slots(i, 0, n), torch.float64)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("page,heads,r,dr,splits,partials", [(1, 4, 32, 8, 1, torch.float32),
                                                             (16, 20, 48, 16, 3, torch.float32),
                                                             (4, 16, 64, 8, 4, torch.float32),
                                                             (4, 16, 64, 8, 3, torch.bfloat16)])
def test_mla_decode_kernel_matches_float64(page, heads, r, dr, splits, partials, kv_cache_dtype):
    """`partials`: the scratch dtype of the splits' outputs (bfloat16: stage 1 rounds each split's normalised output
    into it and the merge sums in float32)."""
    lens = [1, 37, 90]
    c = Latents(lens, page, r, dr, torch.float32, kv_cache_dtype, seed=page)
    for i, n in enumerate(lens):
        c.store(i, 0, n)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    kv_indices = torch.zeros(sum(lens), dtype=torch.int32)
    build_kv_indices(c.r2t.req_to_token, torch.tensor(c.rows), kv_indptr, kv_indices)
    q = torch.randn(len(lens), heads, r + dr, generator=c.gen)
    out = torch.full((len(lens), heads, r), float("nan"))
    mid_o = torch.empty(len(lens), heads, splits, r, dtype=partials)
    mid_lse = torch.empty(len(lens), heads, splits)
    scale = 0.8 * (r + dr) ** -0.5
    mla_decode_attention(q, c.pool.kv_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse, scale, r,
                         kv_scale=c.pool.kv_scale[0], fp8_dtype=c.pool.fp8_dtype,
                         config=MLADecodeConfig(min_chunk=16), interpret=True)
    for i, n in enumerate(lens):
        lat = c.stored(i, n)
        scores = torch.einsum("hd,ld->hl", q[i].double(), lat) * scale
        ref = torch.softmax(scores, -1) @ lat[:, :r]
        tol = 2e-5 if partials == torch.float32 else 1e-2 * max(1.0, ref.abs().max().item())
        assert (out[i].double() - ref).abs().max().item() < tol, i


@pytest.mark.parametrize("kv_cache_dtype,dtype", [("fp8_e4m3", torch.float16), ("fp8_e5m2", torch.float32)])
def test_wide_launch_takes_fp8_latents(kv_cache_dtype, dtype):
    """The 64-head launch (`wide_launch`: what bf16 gets on SM90) on fp8 latents: 70 heads (a full and a masked
    head block), 64-key tiles over three splits, float64 over the stored bytes. The interpreter checks the
    logic; the wgmma code itself compiles for sm_90a (mla_decode.WIDE_LAUNCH) and is timed by bench_mla_decode."""
    from sglx.attention.kernels.mla_decode import head_blocks, wide_launch

    page, heads, r, dr, splits, lens = 16, 70, 64, 16, 3, [1, 37, 150]
    config = wide_launch(MLADecodeConfig(min_chunk=16))
    assert head_blocks(heads, config) == 2 and config.block_n == 64
    c = Latents(lens, page, r, dr, dtype, kv_cache_dtype, seed=7)
    for i, n in enumerate(lens):
        c.store(i, 0, n)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    kv_indices = torch.zeros(sum(lens), dtype=torch.int32)
    build_kv_indices(c.r2t.req_to_token, torch.tensor(c.rows), kv_indptr, kv_indices)
    q = torch.randn(len(lens), heads, r + dr, generator=c.gen).to(dtype)
    out = torch.full((len(lens), heads, r), float("nan"), dtype=dtype)
    mid_o = torch.empty(len(lens), heads, splits, r)
    mid_lse = torch.empty(len(lens), heads, splits)
    scale = 0.8 * (r + dr) ** -0.5
    mla_decode_attention(q, c.pool.kv_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse, scale, r,
                         kv_scale=c.pool.kv_scale[0], fp8_dtype=c.pool.fp8_dtype, config=config, interpret=True)
    for i, n in enumerate(lens):
        lat = c.stored(i, n)
        scores = torch.einsum("hd,ld->hl", q[i].double(), lat) * scale
        ref = torch.softmax(scores, -1) @ lat[:, :r]
        assert (out[i].double() - ref).abs().max().item() < (4e-3 if dtype == torch.float16 else 2e-5), i


@pytest.mark.parametrize("partials", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_hm,block_dv", [(1, 32), (4, 64), (8, 128)])
def test_merge_kernel_matches_float64_at_each_program_shape(block_hm, block_dv, partials):
    """Stage 2 on its own, at head x column blocks `merge_launch` can pick (12 heads: a masked head block at 8;
    latent 80: masked columns at 64 and 128): out = sum_s 2**lse_s o_s / sum_s 2**lse_s over the splits that hold
    keys (a 20-key request two of three, a 1-key one one), float64 reference, NaN in the unused partials."""
    from sglx.attention.kernels.mla_decode import _mla_merge_kernel

    lens, heads, r, splits, min_chunk, block_n = [20, 1, 90], 12, 80, 3, 16, 16
    gen = torch.Generator().manual_seed(5)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    mid_o = torch.randn(len(lens), heads, splits, r, generator=gen).to(partials)  # bf16: summed in float32
    mid_lse = torch.randn(len(lens), heads, splits, generator=gen) * 4
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def n_active(n: int) -> int:  # _split_range: n_splits = min(cdiv(n, min_chunk), splits), chunk in BLOCK_N steps
        chunk = cdiv(cdiv(n, min(max(cdiv(n, min_chunk), 1), splits)), block_n) * block_n
        return cdiv(n, chunk)

    active = [n_active(n) for n in lens]
    assert active == [2, 1, 3]
    for i, n_active in enumerate(active):
        mid_o[i, :, n_active:] = float("nan")
        mid_lse[i, :, n_active:] = float("nan")
    out = torch.full((len(lens), heads, r), float("nan"))
    grid = (len(lens), -(-heads // block_hm), -(-r // block_dv))
    _mla_merge_kernel[grid](mid_o, mid_lse, out, kv_indptr, splits, min_chunk, *mid_o.stride()[:3],
                            *mid_lse.stride()[:2], *out.stride()[:2], H=heads, R=r, BLOCK_HM=block_hm,
                            BLOCK_DV=block_dv, BLOCK_S=4, BLOCK_N=block_n, num_warps=1)
    for i, n_active in enumerate(active):
        w = torch.softmax(mid_lse[i, :, :n_active].double() * torch.log(torch.tensor(2.0, dtype=torch.float64)), -1)
        ref = (w[..., None] * mid_o[i, :, :n_active].double()).sum(1)
        assert (out[i].double() - ref).abs().max().item() < 1e-5, i


def test_split_query_halves_read_in_place_equal_the_concatenated_query():
    """q_pe given apart (as the backend passes it: a slice of the projected q, and the latent half a transposed bmm
    result) gives bitwise the output of the concatenated query; mismatched halves are refused."""
    lens, heads, r, dr = [5, 40], 6, 32, 8
    c = Latents(lens, 4, r, dr, torch.float32, seed=11)
    for i, n in enumerate(lens):
        c.store(i, 0, n)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32))
    kv_indices = torch.zeros(sum(lens), dtype=torch.int32)
    build_kv_indices(c.r2t.req_to_token, torch.tensor(c.rows), kv_indptr, kv_indices)
    q_lat = torch.randn(heads, len(lens), r, generator=c.gen).transpose(0, 1)  # [bs, H, R], not contiguous
    q_pe = torch.randn(len(lens), heads, 24 + dr, generator=c.gen)[..., 24:]  # a strided slice
    outs = []
    for args in ((torch.cat([q_lat, q_pe], -1), None), (q_lat, q_pe)):
        out = torch.full((len(lens), heads, r), float("nan"))
        mla_decode_attention(args[0], c.pool.kv_buffer[0], out, kv_indptr, kv_indices, torch.empty(2, heads, 3, r),
                             torch.empty(2, heads, 3), 0.3, r, config=MLADecodeConfig(min_chunk=16), interpret=True,
                             q_pe=args[1])
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    with pytest.raises(ValueError, match="do not fit kv_lora_rank"):
        mla_decode_attention(q_lat[..., :16], c.pool.kv_buffer[0], outs[0], kv_indptr, kv_indices,
                             torch.empty(2, heads, 3, r), torch.empty(2, heads, 3), 0.3, r, q_pe=q_pe, interpret=True)


@pytest.mark.parametrize("tokens", [1, 5])
def test_per_head_gemv_matches_float64_for_both_mla_products(tokens):
    """absorb (x [T, H, dn] strided, W_UK [H, dn, r]) and W_UV (o [T, H, r], W_UV^T: a transposed view) against
    float64; widths that are not powers of two; the bmm path of absorb_q / apply_uv agrees."""
    from sglx.attention.kernels.per_head_gemv import per_head_gemv

    gen = torch.Generator().manual_seed(tokens)
    heads, dn, dv, r = 3, 12, 10, 40
    spec = MLALayerSpec(0, heads, dn, 4, dv, r, 0.5)
    proj = MLAProjections.from_kv_b_proj(torch.randn(heads * (dn + dv), r, generator=gen), spec)
    q = torch.randn(tokens, heads, dn + 4, generator=gen)[..., :dn]  # q_nope: a slice, as the model passes it
    got = absorb_q(q, proj, kernel=True, interpret=True)
    torch.testing.assert_close(got.double(), torch.einsum("thd,hdr->thr", q.double(), proj.w_uk.double()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, absorb_q(q, proj), rtol=1e-5, atol=1e-5)
    o = torch.randn(tokens, heads, r, generator=gen)
    out = torch.full((tokens, heads, dv), float("nan"))
    assert apply_uv(o, proj, out, kernel=True, interpret=True) is out
    torch.testing.assert_close(out.double(), torch.einsum("thr,hvr->thv", o.double(), proj.w_uv.double()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, apply_uv(o, proj), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        per_head_gemv(o, proj.w_uk, interpret=True)
    many = torch.randn(20, heads, r, generator=gen)  # two 16-token blocks, the second one masked
    torch.testing.assert_close(per_head_gemv(many, proj.w_uv.transpose(1, 2), interpret=True).double(),
                               torch.einsum("thr,hvr->thv", many.double(), proj.w_uv.double()), rtol=1e-5, atol=1e-5)


def test_apply_uv_into_a_contiguous_output_equals_the_view():
    gen = torch.Generator().manual_seed(4)
    proj = MLAProjections.from_kv_b_proj(torch.randn(3 * (5 + 7), 16, generator=gen),
                                         MLALayerSpec(0, 3, 5, 4, 7, 16, 0.5))
    o_latent = torch.randn(9, 3, 16, generator=gen)
    out = torch.empty(9, 3, 7)
    got = apply_uv(o_latent, proj, out)
    assert got is out and got.is_contiguous()
    torch.testing.assert_close(got, apply_uv(o_latent, proj), rtol=0, atol=0)


H, DN, DR, DV, R = 4, 16, 8, 12, 32
SPEC = MLALayerSpec(0, H, DN, DR, DV, R, 0.7 * (DN + DR) ** -0.5)
PREFIX = [0, 13, 37]
STEPS = [(ForwardMode.EXTEND, [21, 6, 1]), (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.MIXED, [1, 4, 1]),
         (ForwardMode.DECODE, [1, 1, 1])]


def _batch(c, mode, lo, new, backend):
    hi = [a + n for a, n in zip(lo, new)]
    extend = mode.is_extend
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long),
        positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]),
        req_pool_indices=torch.tensor(c.rows), seq_lens=torch.tensor(hi),
        out_cache_loc=torch.cat([c.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))]),
        req_to_token_pool=c.r2t, token_kv_pool=c.pool, attn_backend=backend, seq_lens_cpu=hi,
        extend_seq_lens_cpu=list(new) if extend else [], extend_prefix_lens_cpu=list(lo) if extend else [],
    )


@pytest.mark.parametrize("page,kv_cache_dtype,budget", [(1, "auto", None), (16, "auto", None), (4, "fp8_e4m3", None),
                                                        (4, "auto", 1)])
def test_triton_mla_backend_matches_torch_native_and_float64(page, kv_cache_dtype, budget):
    """budget 1 byte: every request's extend runs as its own group (bounded expansion)."""
    total = [p + sum(n[i] for _, n in STEPS) for i, p in enumerate(PREFIX)]
    ours, theirs = (Latents(total, page, R, DR, torch.float32, kv_cache_dtype, seed=7) for _ in range(2))
    backends = []
    for c, cls in ((ours, TritonMLABackend), (theirs, TorchNativeMLABackend)):
        for i, p in enumerate(PREFIX):
            if p:
                c.store(i, 0, p)
        backends.append(cls(BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, page, c.r2t, c.pool)))
    if budget is not None:
        backends[0].max_expanded_bytes = budget
        assert len(backends[0]._extend_groups(_batch(ours, STEPS[0][0], PREFIX, STEPS[0][1], None), SPEC, 4)) == 3
    gen = torch.Generator().manual_seed(1)
    proj = MLAProjections.from_kv_b_proj(torch.randn(H * (DN + DV), R, generator=gen) * R ** -0.5, SPEC)
    lo = list(PREFIX)
    for mode, new in STEPS:
        q_nope = torch.randn(sum(new), H, DN, generator=gen)
        q_pe = torch.randn(sum(new), H, DR, generator=gen)
        latent = torch.cat([lat[a:a + n] for lat, a, n in zip(ours.latents, lo, new)])
        outs = []
        for c, backend in zip((ours, theirs), backends):
            batch = _batch(c, mode, lo, new, backend)
            backend.init_forward_metadata(batch)
            outs.append(backend.forward_mla(q_nope, q_pe, latent[:, :R], latent[:, R:], SPEC, proj, batch))
        assert torch.equal(ours.pool.kv_buffer[0], theirs.pool.kv_buffer[0])
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)
        offset = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            ref = reference_mla(q_nope[offset:offset + n], q_pe[offset:offset + n], ours.stored(i, a + n),
                                proj.w_uk, proj.w_uv, torch.arange(a, a + n), SPEC.scaling)
            assert (outs[0][offset:offset + n].double() - ref).abs().max().item() < 2e-5
            offset += n
        lo = [a + n for a, n in zip(lo, new)]


def test_split_count_is_sized_by_head_blocks():
    """One stage-1 program per 16 heads: DeepSeek-V3's 128 heads are 8 programs per split, not 1 (fewer splits)."""
    from sglx.attention.kernels.mla_decode import head_blocks

    assert [head_blocks(h) for h in (4, 16, 20, 128)] == [1, 1, 2, 8]
    c = Latents([5], 1, R, DR, torch.float32)
    backend = TritonMLABackend(BackendContext(torch.device("cpu"), torch.float32, 128, 1, R + DR, 1, c.r2t, c.pool))
    assert backend._programs_per_split() == 8


def test_absorbed_decode_helpers_round_trip():
    """absorb_q / apply_uv are the bmm forms of the einsums the reference uses."""
    gen = torch.Generator().manual_seed(2)
    proj = MLAProjections.from_kv_b_proj(torch.randn(H * (DN + DV), R, generator=gen), SPEC)
    q = torch.randn(3, H, DN, generator=gen)
    torch.testing.assert_close(absorb_q(q, proj), torch.einsum("thd,hdr->thr", q, proj.w_uk))
    o = torch.randn(3, H, R, generator=gen)
    torch.testing.assert_close(apply_uv(o, proj), torch.einsum("thr,hvr->thv", o, proj.w_uv))


def test_hybrid_prefill_torch_native_decode_triton():
    """HybridAttentionBackend routes forward_mla by phase over the one latent pool both backends share."""
    from sglx.attention.llm.hybrid import HybridAttentionBackend

    total = [p + sum(n[i] for _, n in STEPS) for i, p in enumerate(PREFIX)]
    c = Latents(total, 4, R, DR, torch.float32, seed=9)
    for i, p in enumerate(PREFIX):
        if p:
            c.store(i, 0, p)
    ctx = BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, 4, c.r2t, c.pool)
    backend = HybridAttentionBackend(ctx, TorchNativeMLABackend(ctx), TritonMLABackend(ctx))
    calls = []
    for name, part in (("prefill", backend.prefill), ("decode", backend.decode)):
        original = part.forward_mla
        part.forward_mla = lambda *a, _n=name, _f=original, **k: (calls.append(_n), _f(*a, **k))[1]
    gen = torch.Generator().manual_seed(3)
    proj = MLAProjections.from_kv_b_proj(torch.randn(H * (DN + DV), R, generator=gen) * R ** -0.5, SPEC)
    lo = list(PREFIX)
    for mode, new in STEPS:
        q_nope = torch.randn(sum(new), H, DN, generator=gen)
        q_pe = torch.randn(sum(new), H, DR, generator=gen)
        latent = torch.cat([lat[a:a + n] for lat, a, n in zip(c.latents, lo, new)])
        batch = _batch(c, mode, lo, new, backend)
        backend.init_forward_metadata(batch)
        out = backend.forward_mla(q_nope, q_pe, latent[:, :R], latent[:, R:], SPEC, proj, batch)
        offset = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            ref = reference_mla(q_nope[offset:offset + n], q_pe[offset:offset + n], c.stored(i, a + n),
                                proj.w_uk, proj.w_uv, torch.arange(a, a + n), SPEC.scaling)
            assert (out[offset:offset + n].double() - ref).abs().max().item() < 2e-5
            offset += n
        lo = [a + n for a, n in zip(lo, new)]
    assert calls == ["prefill", "decode", "prefill", "decode"]


def test_tiny_deepseek_through_triton_mla_matches_transformers(tmp_path):
    """The whole model on the triton MLA backend (expanded extend, absorbed split-KV decode) vs HF logits."""
    from llm_test_utils import PagedKVHarness, assert_paged_greedy_matches_hf, load_hf_model, make_tiny_model
    from sglx.llm.models import load_model

    path = make_tiny_model(tmp_path, "deepseek_v3")
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    prompt = [1, 57, 203, 99, 12, 310, 44, 8, 150, 77, 201, 5, 66]
    harness = PagedKVHarness(model, page_size=4, max_requests=2, max_context=64)
    kv = harness.kv_pool
    harness.backend = TritonMLABackend(BackendContext(torch.device("cpu"), torch.float32, model.config.num_heads, 1,
                                                      kv.latent_dim, 4, harness.req_pool, kv))
    assert_paged_greedy_matches_hf(harness, hf, prompt, 6)


def test_split_chunk_gives_small_batches_32_key_splits():
    """The 16-head launch's split size (no min_chunk set): 32 keys while batch x head blocks <= 8, then 64 (the H100
    sweep of session 15); an explicit min_chunk wins; mla_num_splits sizes the splits with it."""
    from dataclasses import replace

    from sglx.attention.kernels.mla_decode import mla_num_splits, resolve_config, split_chunk

    config = resolve_config(MLADecodeConfig(), 16, False, torch.device("cpu"), interpret=False)
    assert config.min_chunk is None and config.block_h == 16
    assert [split_chunk(config, bs, 16) for bs in (1, 8, 9, 32)] == [32, 32, 64, 64]
    assert split_chunk(config, 1, 128) == 32 and split_chunk(config, 2, 128) == 64  # 8 / 16 programs (16 heads each)
    assert split_chunk(replace(config, min_chunk=16), 32, 16) == 16
    assert mla_num_splits(1, 16, 544, 132, config) == 17  # 544 keys in 32-key splits
    assert mla_num_splits(16, 16, 544, 132, config) == 9  # 64-key splits
