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

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_deepseek_kernels.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.fused_moe import fused_moe, moe_align  # noqa: E402
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


def test_tiny_deepseek_with_fused_experts_matches_transformers(tmp_path, monkeypatch):
    """The whole model (V3-shaped: sigmoid noaux_tc routing over groups, shared expert) with every MoE layer on
    the fused Triton experts, as on a GPU: logits and greedy tokens equal transformers'."""
    from llm_test_utils import PagedKVHarness, hf_greedy, load_hf_model, make_tiny_model
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
    row = harness.new_request()
    logits = harness.extend([(row, prompt)], return_all_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)
    tokens, ref = hf_greedy(hf, prompt, 6)
    got = [int(logits[-1].argmax())]
    for step in range(1, 6):
        step_logits = harness.decode([(row, got[-1])])[0]
        torch.testing.assert_close(step_logits, ref[step], atol=1e-4, rtol=1e-4)
        got.append(int(step_logits.argmax()))
    assert got == tokens
    assert calls and len(calls) == 2 * 6  # both MoE layers, prefill + 5 decode steps, all fused
