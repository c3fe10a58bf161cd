"""Prefill CUDA graphs' static-buffer step, under TRITON_INTERPRET=1 (no GPU needed).

Launched by tests/test_prefill_graph.py. `PrefillGraphRunner(capture=False)` runs exactly what a graph
holds (the padded two-request batch, the triton backend's in-graph index build, the model) eagerly.
On a tiny random Llama, each single-request prefill (bucket padding, an exact-bucket prompt, a cached
prefix) must give Hugging Face's last-token logits and the eager triton path's, leave every real KV
slot as the eager path does and write nothing else but slot 0 (the padding page); a decode step after
it must match too.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_prefill_graph.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from llm_test_utils import PagedKVHarness, load_hf_model, make_tiny_model  # noqa: E402
from sglx.attention.llm.base import BackendContext  # noqa: E402
from sglx.attention.llm.hybrid import HybridAttentionBackend  # noqa: E402
from sglx.attention.llm.torch_native import TorchNativeBackend  # noqa: E402
from sglx.attention.llm.triton import TritonBackend  # noqa: E402
from sglx.llm.cuda_graph_runner import GraphTarget  # noqa: E402
from sglx.llm.forward_batch import ForwardMode  # noqa: E402
from sglx.llm.models import load_model  # noqa: E402
from sglx.llm.prefill_graph_runner import PrefillGraphPlan, PrefillGraphRunner  # noqa: E402

TOL = dict(atol=2e-4, rtol=2e-4)


def _triton_harness(model, page_size: int, hybrid: bool = False) -> PagedKVHarness:
    """Triton for every step, or (hybrid) triton prefill + torch_native decode over the same pools."""
    h = PagedKVHarness(model, page_size=page_size, max_context=128, seed=3)
    cfg = model.config
    ctx = BackendContext(device=torch.device("cpu"), dtype=torch.float32, num_q_heads=cfg.num_heads,
                         num_kv_heads=h.kv_pool.num_kv_heads, head_dim=h.kv_pool.head_dim, page_size=page_size,
                         req_to_token_pool=h.req_pool, token_kv_pool=h.kv_pool)
    triton = TritonBackend(ctx)
    h.backend = HybridAttentionBackend(ctx, triton, TorchNativeBackend(ctx)) if hybrid else triton
    return h


def test_a_hybrid_pair_has_prefill_graphs_when_its_prefill_backend_does(tiny):
    h = _triton_harness(tiny[0], 1)
    ctx = h.backend.ctx
    assert HybridAttentionBackend(ctx, TritonBackend(ctx), TorchNativeBackend(ctx)).supports_prefill_cuda_graph
    assert not HybridAttentionBackend(ctx, TorchNativeBackend(ctx), TritonBackend(ctx)).supports_prefill_cuda_graph


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("prefill_graph"), "llama")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    return model, load_hf_model(model_dir)


@pytest.mark.parametrize("hybrid", [False, True], ids=["triton", "triton-prefill-torch-native-decode"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_static_prefill_step_matches_eager_triton_and_hf(tiny, page_size, hybrid):
    model, hf = tiny
    eager, graphed = _triton_harness(model, page_size), _triton_harness(model, page_size, hybrid)
    plan = PrefillGraphPlan(True, 64, (16, 32, 64), "test")
    runner = PrefillGraphRunner(GraphTarget(torch.device("cpu"), model, graphed.backend, graphed.req_pool,
                                            graphed.kv_pool), plan, capture=False)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    first = torch.randint(1, vocab, (37,), generator=gen).tolist()  # bucket 64: 27 padding rows
    exact = torch.randint(1, vocab, (32,), generator=gen).tolist()  # exactly bucket 32: no padding
    tail = torch.randint(1, vocab, (9,), generator=gen).tolist()  # on a 32-token cached prefix: bucket 16
    # a kernel that ignored kv_indptr would read slot 0 (padding): make it loud
    for h in (eager, graphed):
        for layer in range(model.config.num_layers):
            h.kv_pool.k_buffer[layer][0].fill_(1e3)

    rows = {}
    for name, share, ids in (("first", None, first), ("exact", None, exact), ("prefixed", "first", tail)):
        per = []
        for h in (eager, graphed):
            shared = 32 if share else 0
            rows.setdefault((id(h), name), h.new_request(share_from=rows.get((id(h), share)), shared_len=shared))
            per.append(rows[(id(h), name)])
        assert per[0] == per[1]
        want = eager.extend([(per[0], ids)])
        batch = graphed.build_batch(ForwardMode.EXTEND, [per[1]], [ids])
        assert runner.can_run(batch)
        with torch.no_grad():
            got = runner.replay(batch)
        assert got.shape == (1, vocab)
        torch.testing.assert_close(got, want, **TOL)
        full = (first[:32] + tail) if share else ids
        torch.testing.assert_close(got[0], hf(torch.tensor([full])).logits[0, -1].float(), **TOL)
    assert runner.replays == 3

    # every slot but the padding page's slot 0 holds what the eager path stored
    for layer in range(model.config.num_layers):
        for buf in ("k_buffer", "v_buffer"):
            a, b = getattr(eager.kv_pool, buf)[layer], getattr(graphed.kv_pool, buf)[layer]
            torch.testing.assert_close(b[1:], a[1:], atol=1e-6, rtol=0)
    # a decode step on the graph-prefilled cache
    row = rows[(id(graphed), "first")]
    torch.testing.assert_close(graphed.decode([(row, 5)]), eager.decode([(row, 5)]), **TOL)


def test_batches_a_prefill_graph_cannot_take_run_eagerly(tiny):
    model, _ = tiny
    h = _triton_harness(model, 1)
    runner = PrefillGraphRunner(GraphTarget(torch.device("cpu"), model, h.backend, h.req_pool, h.kv_pool),
                                PrefillGraphPlan(True, 32, (16, 32), "test"), capture=False)
    a, b = h.new_request(), h.new_request()
    assert not runner.can_run(h.build_batch(ForwardMode.EXTEND, [a, b], [[1, 2], [3]]))  # two requests
    assert not runner.can_run(h.build_batch(ForwardMode.EXTEND, [a], [list(range(1, 34))]))  # 33 > 32 tokens
    assert not runner.can_run(h.build_batch(ForwardMode.EXTEND, [b], [[4, 5]], return_all_logits=True))
    assert not runner.can_run(h.build_batch(ForwardMode.DECODE, [b], [[6]]))


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("prefill_graph_mla"), "deepseek_v2")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    return model, load_hf_model(model_dir)


def _triton_mla_harness(model, page_size: int) -> PagedKVHarness:
    from sglx.attention.llm.triton_mla import TritonMLABackend

    h = PagedKVHarness(model, page_size=page_size, max_context=128, seed=3)
    kv = h.kv_pool
    h.backend = TritonMLABackend(BackendContext(torch.device("cpu"), torch.float32, model.config.num_heads, 1,
                                                kv.latent_dim, page_size, h.req_pool, kv))
    return h


@pytest.mark.parametrize("page_size", [1, 4])
def test_mla_static_prefill_step_matches_eager_triton_and_hf(tiny_deepseek, page_size):
    """triton MLA in the prefill graphs' static step: a padded prompt, an exact-bucket one and one on a 32-token cached
    prefix give the eager path's and Hugging Face's logits and latents; a cached prefix longer than the keys a graph
    expands beyond its bucket (the largest bucket, 64 here) is refused (it prefills eagerly)."""
    model, hf = tiny_deepseek
    eager, graphed = _triton_mla_harness(model, page_size), _triton_mla_harness(model, page_size)
    runner = PrefillGraphRunner(GraphTarget(torch.device("cpu"), model, graphed.backend, graphed.req_pool,
                                            graphed.kv_pool), PrefillGraphPlan(True, 64, (16, 32, 64), "test"),
                                capture=False)
    assert graphed.backend.graph_prefix_cap == 64
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    first = torch.randint(1, vocab, (37,), generator=gen).tolist()  # bucket 64: 27 padding rows
    exact = torch.randint(1, vocab, (32,), generator=gen).tolist()
    tail = torch.randint(1, vocab, (9,), generator=gen).tolist()  # bucket 16 on 32 cached tokens of `first`
    rows = {}
    for name, share, ids in (("first", None, first), ("exact", None, exact), ("prefixed", "first", tail)):
        rows[name] = tuple(h.new_request(share_from=rows[share][i] if share else None, shared_len=32 if share else 0)
                           for i, h in enumerate((eager, graphed)))
        want = eager.extend([(rows[name][0], ids)])
        batch = graphed.build_batch(ForwardMode.EXTEND, [rows[name][1]], [ids])
        assert runner.can_run(batch)
        with torch.no_grad():
            got = runner.replay(batch)
        torch.testing.assert_close(got, want, **TOL)
        full = first[:32] + tail if share else ids
        torch.testing.assert_close(got[0], hf(torch.tensor([full])).logits[0, -1].float(), **TOL)
    assert runner.replays == 3
    for layer in range(model.config.num_layers):  # every latent but the padding page's slot 0 as eager stored it
        torch.testing.assert_close(graphed.kv_pool.kv_buffer[layer][1:], eager.kv_pool.kv_buffer[layer][1:],
                                   atol=1e-6, rtol=0)
    row_e, row_g = rows["first"]
    torch.testing.assert_close(graphed.decode([(row_g, 5)]), eager.decode([(row_e, 5)]), **TOL)
    long = graphed.new_request()
    graphed.extend([(long, torch.randint(1, vocab, (68,), generator=gen).tolist())])  # eagerly: > 64 tokens
    on_long = graphed.new_request(share_from=long, shared_len=68)
    assert not runner.can_run(graphed.build_batch(ForwardMode.EXTEND, [on_long], [[5, 6, 7]]))
