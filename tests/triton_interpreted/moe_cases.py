"""sglx.llm.kernels.fused_moe (expert sort + two grouped GEMMs) vs float64 and the per-expert loop, interpreted.

Runs only under TRITON_INTERPRET=1 (tests/test_deepseek_kernels.py launches it in a child pytest). The float64
reference is the MoE formula itself, sum_k w_k * W2_e (silu(W1_e x) * W3_e x); the per-expert loop is
the path RoutedExperts takes on CPU (exact, HF's order), so the fused path must agree with it too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import triton

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_deepseek_kernels.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.fused_moe import fused_moe  # noqa: E402
from sglx.llm.kernels.moe_align import moe_align  # noqa: E402
from sglx.llm.layers.moe import RoutedExperts  # noqa: E402


def _reference(x, w13, w2, weights, ids):
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _case(tokens, experts, top_k, hidden, inter, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    scores = torch.rand(tokens, experts, generator=gen)
    if skew:  # most tokens pick the same experts: blocks of one expert fill up and spill into more blocks
        scores[:, :top_k] += 1.0
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,skew", [
    (1, 8, 2, 48, 40, False),     # decode: 2 rows, 2 blocks; K and N not multiples of the tiles
    (5, 16, 4, 64, 32, False),
    (37, 8, 2, 32, 24, True),     # one expert gets ~37 rows: several blocks of one expert
    (3, 64, 6, 32, 16, False),    # many experts, most empty (DeepSeek-V2-Lite's 64 / top-6)
])
def test_fused_moe_matches_float64_and_the_loop(tokens, experts, top_k, hidden, inter, skew):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, seed=tokens, skew=skew)
    got = fused_moe(x, w13, w2, weights, ids, interpret=True)
    ref = _reference(x, w13, w2, weights, ids)
    assert (got.double() - ref).abs().max().item() < 1e-4
    layer = RoutedExperts(experts, hidden, inter)
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    torch.testing.assert_close(got, layer.forward_loop(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_float16_within_rounding():
    """Half precision (the interpreter's tl.dot mishandles bfloat16 bits; bf16 is checked on the GPU)."""
    x, w13, w2, weights, ids = _case(9, 8, 2, 64, 48, seed=3, skew=True)
    got = fused_moe(x.half(), w13.half(), w2.half(), weights, ids, interpret=True)
    ref = _reference(x.half(), w13.half(), w2.half(), weights, ids)
    assert got.dtype == torch.float16
    assert (got.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_adds_the_shared_output_after_rounding_the_sum(dtype):
    """add= (the shared experts' output) joins the top-k sum: rounded where `routed.to(dtype) + shared` rounds."""
    x, w13, w2, weights, ids = _case(6, 8, 2, 32, 16, seed=5)
    shared = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    x16, w13_16, w2_16 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    if dtype == torch.bfloat16:  # the interpreter's tl.dot mishandles bf16: compare the epilogue alone
        from sglx.llm.kernels import fused_moe as fm

        y = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
        out = torch.empty(6, 32, dtype=dtype)
        fm._moe_sum_kernel[(6, 1)](y, shared, out, 2, 32, y.stride(0), shared.stride(0), out.stride(0),
                                   HAS_ADD=True, BLOCK=32)
        assert torch.equal(out, y.view(6, 2, 32).sum(1).to(dtype) + shared)
        return
    got = fused_moe(x16, w13_16, w2_16, weights, ids, interpret=True, add=shared)
    plain = fused_moe(x16, w13_16, w2_16, weights, ids, interpret=True)
    assert torch.equal(got, plain + shared)


def test_align_sorts_pairs_stably_into_one_expert_blocks():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]])
    sorted_ids, block_expert, block_rows = moe_align(ids, 4, 16)
    assert block_expert.numel() == -(-(8 + 4 * 15) // 16)  # host-side bound: pairs + min(E, pairs) * (BM - 1)
    flat = ids.reshape(-1).tolist()
    seen = []
    for b, (e, n) in enumerate(zip(block_expert.tolist(), block_rows.tolist())):
        if e < 0:
            assert n == 0
            continue
        rows = sorted_ids[b * 16:b * 16 + n].tolist()
        assert all(flat[p] == e for p in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == list(range(8))
    assert [e for e in block_expert.tolist() if e >= 0] == [0, 1, 2, 3]


def _crowded_routing(tokens: int, k: int, experts: int, seed: int) -> torch.Tensor:
    """Random top-k ids where a few experts are crowded (their runs span blocks) and others get nothing."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    if experts > 8:
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.5, ids % 5, ids)
    return ids


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("tokens,k,experts,block_m,per_program", [
    (1, 8, 66, 16, None), (37, 6, 64, 16, None), (64, 8, 66, 64, None), (5, 2, 4, 16, None), (90, 3, 7, 32, None),
    (140, 8, 66, 16, 32),  # 35 slices: more than the scan's tile of 32 slices at 128 padded experts
    (40, 9, 257, 64, 16),  # DeepSeek-V3's 256 routed + 1 shared: 512 padded experts, scan tiles of 8 slices
    (40, 9, 257, 16, None),  # 6 slices of 64 pairs, 264 blocks: each program writes several 16-block chunks
])
def test_align_lays_out_pairs_as_a_stable_torch_sort(tokens, k, experts, block_m, per_program, one_program,
                                                     monkeypatch):
    """Both launch shapes of moe_align (one program; count, scan, place over many programs) against a stable
    torch argsort: the same blocks, experts, row counts and pair order."""
    from moe_align_reference import align_by_torch_sort, assert_same_alignment
    from sglx.llm.kernels import moe_align as ma

    if per_program is not None:
        monkeypatch.setattr(ma, "MAX_PAIRS_PER_PROGRAM", per_program)
    ids = _crowded_routing(tokens, k, experts, tokens * 7 + k)
    got = ma.moe_align(ids, experts, block_m, one_program=one_program)
    if not one_program and per_program is not None:  # the scan walks several tiles of slices
        block_e = triton.next_power_of_2(experts)
        slices = triton.cdiv(ids.numel(), ma.pairs_per_program(ids.numel(), ids.device, ma._chunk(block_e)))
        assert slices > 4096 // block_e
    assert_same_alignment(got, align_by_torch_sort(ids, experts, block_m), block_m)


def test_many_pairs_take_three_launches_and_give_the_one_programs_output(monkeypatch):
    """Past ONE_PROGRAM_MAX_PAIRS moe_align runs over many programs; fused_moe's output is bitwise the one-program
    layout's."""
    from sglx.llm.kernels import moe_align as ma

    gen = torch.Generator().manual_seed(5)
    tokens, k, experts, hidden, inter = 90, 6, 8, 32, 16
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    assert tokens * k > ma.ONE_PROGRAM_MAX_PAIRS
    launched = []
    real = ma._align_scan_kernel
    monkeypatch.setattr(ma, "_align_scan_kernel", _Recorder(real, launched))
    many = fused_moe(x, w13, w2, weights, ids, interpret=True)
    assert len(launched) == 1
    monkeypatch.setattr(ma, "ONE_PROGRAM_MAX_PAIRS", 10**6)
    one = fused_moe(x, w13, w2, weights, ids, interpret=True)
    assert len(launched) == 1 and torch.equal(many, one)


class _Recorder:
    """A kernel whose launches are counted."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_tiny_deepseek_with_fused_experts_matches_transformers(tmp_path, monkeypatch):
    """The whole model (V3-shaped: sigmoid noaux_tc routing over groups, shared expert) with every MoE layer on
    the fused Triton experts, as on a GPU: logits and greedy tokens equal transformers'."""
    from llm_test_utils import PagedKVHarness, assert_paged_greedy_matches_hf, load_hf_model, make_tiny_model
    from sglx.llm.models import load_model

    calls = []

    def fused(self, x, weights, ids, add=None):
        calls.append(x.shape[0])
        return self.forward_fused(x, weights, ids, add)

    monkeypatch.setattr(RoutedExperts, "forward", fused)
    path = make_tiny_model(tmp_path, "deepseek_v3")
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    prompt = [1, 57, 203, 99, 12, 310, 44, 8, 150, 77, 201, 5, 66]
    harness = PagedKVHarness(model, page_size=4, max_requests=2, max_context=64)
    assert_paged_greedy_matches_hf(harness, hf, prompt, 6)
    assert calls and len(calls) == 2 * 6  # both MoE layers, prefill + 5 decode steps, all fused


@pytest.mark.parametrize("tokens,experts,top_k,hidden,renorm,scale", [
    (1, 64, 6, 40, False, 1.0),   # V2-Lite's 64 / top-6, one decode token; H not a multiple of the block
    (5, 8, 2, 48, True, 1.0),     # V2's renormalised top-k
    (3, 20, 3, 16, False, 2.5),   # experts not a power of two, scaled weights
    (4, 6, 1, 32, False, 1.0),    # top-1
])
def test_greedy_router_matches_float64_softmax_topk(tokens, experts, top_k, hidden, renorm, scale):
    from sglx.llm.kernels.moe_router import greedy_router

    gen = torch.Generator().manual_seed(experts + tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(experts, hidden, generator=gen)
    tickets = torch.zeros(8, dtype=torch.int32)
    weights, ids, aligned, normed = greedy_router(x, w, top_k, renorm, scale, tickets, interpret=True)
    assert aligned is None and normed is None
    assert not tickets.any()  # left zero for the next launch (CUDA graph replays)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, top_k)
    scores = (x.double() @ w.double().T).softmax(-1)
    ref_w, ref_ids = torch.topk(scores, top_k, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) if renorm else ref_w * scale
    order = ids.argsort(-1)
    ref_order = ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order).double(), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)
    # the best expert comes first, as a sorted top-k would give it
    assert torch.equal(ids[:, 0], ref_ids[:, 0])


def test_greedy_router_takes_the_lowest_index_on_ties_and_rejects_a_bad_k():
    from sglx.llm.kernels.moe_router import greedy_router

    x = torch.ones(1, 16)
    w = torch.zeros(8, 16)
    w[[2, 5, 6]] = 1.0  # three equal best experts
    _, ids, _, _ = greedy_router(x, w, 2, False, 1.0, interpret=True)
    assert ids.tolist() == [[2, 5]]
    weights, ids, _, _ = greedy_router(x, w, 2, False, 1.0, interpret=True, shared=3)  # + experts 8, 9, 10 of weight 1
    assert ids.tolist() == [[2, 5, 8, 9, 10]] and weights[0, 2:].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="top_k 9"):
        greedy_router(x, w, 9, False, 1.0, interpret=True)
    with pytest.raises(ValueError, match="one token's pairs"):
        greedy_router(torch.ones(2, 16), w, 2, False, 1.0, interpret=True, align_block_m=16)
    with pytest.raises(ValueError, match="router tickets"):
        greedy_router(torch.ones(3, 16), w, 2, False, 1.0, torch.zeros(2, dtype=torch.int32), interpret=True)
    with pytest.raises(ValueError, match="add_norm"):
        greedy_router(x, w, 2, False, 1.0, interpret=True, add_norm=(torch.ones(2, 16), torch.ones(16), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (3, 16)])
def test_greedy_router_with_add_norm_routes_the_normed_row(tokens, hidden, dtype):
    """add_norm: the router forms residual + x and its RMSNorm as fused_add_rms_norm does (the new residual
    bit-equal, the normed row within one rounding step: another float32 summation order) and routes that row:
    the same experts and weights as routing fused_add_rms_norm's output."""
    from sglx.llm.kernels.moe_router import greedy_router
    from sglx.llm.kernels.rmsnorm import fused_add_rms_norm

    experts, top_k = 16, 3
    gen = torch.Generator().manual_seed(hidden + tokens)
    delta = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = (3 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    w = torch.randn(experts, hidden, generator=gen).to(dtype)
    tickets = torch.zeros(4, dtype=torch.int32)
    weights, ids, _, normed = greedy_router(delta, w, top_k, True, 1.0, tickets, interpret=True, shared=1,
                                            add_norm=(residual, norm_w, 1e-6))
    want_h, want_r = fused_add_rms_norm(delta, residual, norm_w, 1e-6)
    h, new_residual = normed
    assert torch.equal(new_residual, want_r)
    step = torch.finfo(dtype).eps * want_h.abs().float().clamp_min(1e-3)
    assert ((h.float() - want_h.float()).abs() <= step + 1e-6).all()
    want_w, want_ids, _, _ = greedy_router(want_h, w, top_k, True, 1.0, interpret=True, shared=1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-3, atol=1e-5)
    assert not tickets.any()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_tiny_deepseek_on_the_gpu_moe_path_matches_transformers(tmp_path, monkeypatch, arch):
    """The MoE layers on their GPU path, interpreted: the routed experts and the shared experts (as experts E..
    of weight 1) in fused_moe's launches; V2's greedy softmax routing in the fused router kernel, V3's sigmoid
    group routing in torch with the shared columns appended. Logits and greedy tokens equal transformers'."""
    from llm_test_utils import PagedKVHarness, assert_paged_greedy_matches_hf, load_hf_model, make_tiny_model
    from sglx.llm.kernels import moe_router
    from sglx.llm.layers import moe
    from sglx.llm.models import load_model

    routed = []
    real_router = moe_router.greedy_router

    def counting_router(*args, **kwargs):
        routed.append((args[0].shape[0], kwargs.get("add_norm") is not None))  # (tokens, post-attention norm inside)
        return real_router(*args, **kwargs)

    monkeypatch.setattr(moe, "fused_moe_applies", lambda device: True)
    monkeypatch.setattr(moe_router, "greedy_router", counting_router)
    shared_calls = []
    real_fused = moe.RoutedExperts.forward_fused

    def counting_fused(self, x, weights, ids, add=None, shared=None, aligned=None):
        # shared in-kernel; the router's own blocks exactly for V2's one-token (decode) steps
        shared_calls.append((shared is not None and add is None, aligned is not None))
        return real_fused(self, x, weights, ids, add, shared, aligned)

    monkeypatch.setattr(moe.RoutedExperts, "forward_fused", counting_fused)
    path = make_tiny_model(tmp_path, arch)
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    prompt = [1, 57, 203, 99, 12, 310, 44, 8, 150, 77, 201, 5, 66]
    harness = PagedKVHarness(model, page_size=4, max_requests=2, max_context=64)
    assert_paged_greedy_matches_hf(harness, hf, prompt, 6)
    moe_layers = sum(isinstance(layer.mlp, moe.DeepseekMoE) for layer in model.model.layers)
    one_token = arch == "deepseek_v2"
    assert moe_layers and shared_calls == [(True, False)] * moe_layers + [(True, one_token)] * (5 * moe_layers)
    # V2: the prompt's 13 tokens route after the norm kernel; each decode token's router takes the norm itself
    assert routed == ([(len(prompt), False)] * moe_layers + [(1, True)] * (5 * moe_layers)
                      if arch == "deepseek_v2" else [])


@pytest.mark.parametrize("tokens,n_shared", [(1, 2), (7, 1)])
def test_fused_moe_runs_shared_experts_as_experts_of_weight_one(tokens, n_shared):
    """shared=(gate_up, down) of a shared MLP S x I wide: ids E..E+S-1 with weight 1 give routed + shared MLP
    (float64 reference: the MLP in one piece, as HF computes it)."""
    experts, top_k, hidden, inter = 8, 2, 48, 24
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, seed=20 + tokens)
    gen = torch.Generator().manual_seed(3)
    s_gate_up = torch.randn(2 * n_shared * inter, hidden, generator=gen) * hidden ** -0.5
    s_down = torch.randn(hidden, n_shared * inter, generator=gen) * inter ** -0.5
    extra = torch.arange(experts, experts + n_shared).expand(tokens, n_shared)
    got = fused_moe(x, w13, w2, torch.cat([weights, torch.ones(tokens, n_shared)], 1), torch.cat([ids, extra], 1),
                    interpret=True, shared=(s_gate_up, s_down))
    gate, up = (x.double() @ s_gate_up.double().T).chunk(2, dim=-1)
    ref = _reference(x, w13, w2, weights, ids) + (F.silu(gate) * up) @ s_down.double().T
    assert (got.double() - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="not slices of width"):
        fused_moe(x, w13, w2, weights, ids, interpret=True, shared=(s_gate_up[:-1], s_down))


@pytest.mark.parametrize("shared", [0, 2])
def test_router_blocks_for_one_token_drive_fused_moe_as_moe_align_does(shared):
    """align_block_m: the router's own one-pair blocks give fused_moe bitwise the output of moe_align's blocks."""
    from sglx.llm.kernels.fused_moe import moe_block_m
    from sglx.llm.kernels.moe_router import greedy_router

    experts, top_k, hidden, inter = 8, 3, 32, 16
    gen = torch.Generator().manual_seed(6 + shared)
    x = torch.randn(1, hidden, generator=gen)
    gate = torch.randn(experts, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    s_weights = (torch.randn(2 * shared * inter, hidden, generator=gen), torch.randn(hidden, shared * inter,
                 generator=gen)) if shared else None
    block_m = moe_block_m(top_k + shared, interpret=True)
    weights, ids, aligned, _ = greedy_router(x, gate, top_k, True, 1.0, interpret=True, shared=shared,
                                          align_block_m=block_m)
    sorted_ids, block_expert, block_rows = aligned
    assert block_expert.tolist() == ids[0].tolist() and block_rows.tolist() == [1] * (top_k + shared)
    assert sorted_ids[::block_m].tolist() == list(range(top_k + shared))
    got = fused_moe(x, w13, w2, weights, ids, interpret=True, shared=s_weights, aligned=aligned)
    want = fused_moe(x, w13, w2, weights, ids, interpret=True, shared=s_weights)
    assert torch.equal(got, want)


@pytest.mark.parametrize("tokens,experts,top_k,n_shared,skew", [(1, 8, 3, 2, False), (5, 16, 4, 0, False),
                                                                (37, 8, 2, 1, True)])
def test_persistent_launch_equals_the_two_gemm_launches(tokens, experts, top_k, n_shared, skew):
    """MoETiles(persistent=True): both GEMMs from one queue of tiles give bitwise the two launches' output; the
    work buffer is left zero, so a second launch (a graph replay) on the same buffer gives it again."""
    from dataclasses import replace

    from sglx.llm.kernels.fused_moe import default_tiles, work_entries

    hidden, inter = 48, 24
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, seed=60 + tokens, skew=skew)
    shared = None
    if n_shared:
        gen = torch.Generator().manual_seed(61)
        shared = (torch.randn(2 * n_shared * inter, hidden, generator=gen) * hidden ** -0.5,
                  torch.randn(hidden, n_shared * inter, generator=gen) * inter ** -0.5)
        extra = torch.arange(experts, experts + n_shared).expand(tokens, n_shared)
        ids = torch.cat([ids, extra], 1)
        weights = torch.cat([weights, torch.ones(tokens, n_shared)], 1)
    want = fused_moe(x, w13, w2, weights, ids, interpret=True, shared=shared)
    tiles = replace(default_tiles(ids.numel(), True), persistent=True)
    work = torch.zeros(work_entries(64), dtype=torch.int32)
    for _ in range(2):
        got = fused_moe(x, w13, w2, weights, ids, interpret=True, shared=shared, tiles=tiles, work=work)
        assert torch.equal(got, want)
        assert not work.any()
    assert (got.double() - _reference_with(x, w13, w2, weights, ids, shared)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="work buffer"):
        fused_moe(x, w13, w2, weights, ids, interpret=True, shared=shared, tiles=tiles, work=work[:1])


def _reference_with(x, w13, w2, weights, ids, shared):
    """float64 MoE with the shared experts as extra experts (ids E.. of weight 1)."""
    if shared is None:
        return _reference(x, w13, w2, weights, ids)
    s13, s2 = shared
    inter = w13.shape[1] // 2
    n_shared = s2.shape[1] // inter
    gate = s13[:n_shared * inter].view(n_shared, inter, -1)
    up = s13[n_shared * inter:].view(n_shared, inter, -1)
    w13_all = torch.cat([w13, torch.cat([gate, up], 1)], 0)
    w2_all = torch.cat([w2, s2.view(-1, n_shared, inter).transpose(0, 1)], 0)
    return _reference(x, w13_all, w2_all, weights, ids)
