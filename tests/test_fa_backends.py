"""fa3/fa4 on CPU: the shared page-table metadata, the kernel calls they make, page-size and hybrid rules, doctor.

The kernels themselves need an SM90/SM100 GPU (tests/gpu/test_fa4_gpu.py runs fa4 there; fa3 cannot be
installed on the lent GPU). Here the metadata is checked against a plain per-token reference built from the
allocator's own slots, and each backend's call is checked by running it against a float64 stand-in that
implements FlashAttention's documented contract (paged K/V through page_table, lengths from seqused_k /
cache_seqlens, causal aligned to the end of the keys, window (left, right), softcap): the outputs must equal
the float64 attention of tests/triton_interpreted/paged.py, so a wrong window offset, causal alignment or
page addressing fails here.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.attention.llm.fa_metadata import FlashGraphState, build_flash_metadata, build_page_table
from sglx.attention.llm.fa_paged import PagedFlashBackend
from sglx.attention.registry import find
from sglx.attention.selection import LLMBackendArgs, ModelTraits, select_llm
from sglx.errors import BackendUnavailableError
from sglx.llm.allocator import TokenSlotAllocator
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool
from sglx.platform import fake

H100 = dict(gpu="NVIDIA H100 80GB HBM3", capability=(9, 0), cuda="13.0")


# ---------------------------------------------------------------- metadata vs a per-token reference

def _random_step(seed: int, page: int, decode: bool) -> tuple[ForwardBatch, list[list[int]]]:
    """Requests allocated by the real allocator (shuffled pages), some sharing a cached prefix in whole pages."""
    rng = random.Random(seed)
    alloc = TokenSlotAllocator(64 * page, page)
    rng.shuffle(alloc._free_pages)  # pages in random order, as a long-running server leaves them
    r2t = ReqToTokenPool(8, 6 * page)
    rows, slots_of, prefix, new = [], [], [], []
    for _ in range(rng.randint(1, 6)):
        row = r2t.alloc()
        assert row is not None
        shared = 0
        if slots_of and rng.random() < 0.5:  # prefix hit: whole pages of an earlier request
            donor = rng.choice(slots_of)
            shared = (len(donor) // page) * page
        cached = shared if decode else shared + rng.choice([0, 0, rng.randint(0, page)])
        total = cached + (1 if decode else rng.randint(1, 2 * page))
        donor_slots = donor[:shared] if shared else []
        own = alloc.alloc_extend([shared], [total], [donor_slots[-1] if donor_slots else 0])
        assert own is not None
        slots = donor_slots + own.tolist()
        r2t.req_to_token[row, :total] = torch.tensor(slots, dtype=torch.int32)
        rows.append(row)
        slots_of.append(slots)
        prefix.append(total - 1 if decode else cached)
        new.append(total - prefix[-1])
    lens = [p + n for p, n in zip(prefix, new)]
    pool = TokenKVPool(64 * page, page, 1, 1, 8, torch.float32)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(sum(new), dtype=torch.long), positions=torch.zeros(sum(new), dtype=torch.long),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), out_cache_loc=torch.zeros(sum(new)),
        req_to_token_pool=r2t, token_kv_pool=pool, extend_seq_lens_cpu=[] if decode else new,
        extend_prefix_lens_cpu=[] if decode else prefix)
    return batch, slots_of


@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
@pytest.mark.parametrize("seed", range(6))
def test_page_table_addresses_every_token_slot(page: int, decode: bool, seed: int) -> None:
    batch, slots_of = _random_step(seed * 7 + page, page, decode)
    meta = build_flash_metadata(batch, page, torch.device("cpu"))
    assert meta.page_table.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.seq_lens.tolist() == batch.seq_lens_cpu and meta.max_seqlen_k == max(batch.seq_lens_cpu)
    assert meta.page_table.shape == (batch.batch_size, -(-max(batch.seq_lens_cpu) // page))
    for i, slots in enumerate(slots_of):  # FlashAttention's addressing: page_table[p // ps] * ps + p % ps
        got = [int(meta.page_table[i, p // page]) * page + p % page for p in range(len(slots))]
        assert got == slots, i
    if decode:
        assert meta.cu_seqlens_q is None and meta.max_seqlen_q == 1
    else:
        expected = [0]
        for n in batch.extend_seq_lens_cpu:
            expected.append(expected[-1] + n)
        assert meta.cu_seqlens_q.tolist() == expected and meta.max_seqlen_q == max(batch.extend_seq_lens_cpu)


@pytest.mark.parametrize("page", [1, 128])
def test_graph_buffers_hold_the_same_table_as_eager(page: int) -> None:
    batch, _ = _random_step(11, page, decode=True)
    r2t = batch.req_to_token_pool
    state = FlashGraphState.allocate(8, r2t.max_context_len, page, torch.device("cpu"))
    bs = batch.batch_size
    static_rows = torch.zeros(8, dtype=torch.long)
    static_lens = torch.ones(8, dtype=torch.long)
    meta = state.capture(bs, static_rows[:bs], static_lens[:bs])
    static_rows[:bs] = batch.req_pool_indices  # what the graph runner copies in before a replay
    static_lens[:bs] = batch.seq_lens
    filled = state.fill(bs, r2t.req_to_token)
    assert filled is meta and meta.page_table.data_ptr() == state.page_table.data_ptr()  # fixed addresses
    eager = build_flash_metadata(batch, page, torch.device("cpu"))
    width = eager.page_table.shape[1]
    assert torch.equal(meta.page_table[:, :width], eager.page_table)
    assert torch.equal(meta.seq_lens, eager.seq_lens) and meta.max_seqlen_k >= eager.max_seqlen_k
    padding = build_page_table(r2t.req_to_token, torch.zeros(1, dtype=torch.long), 1, page)
    assert padding.tolist() == [[0]]  # a padded slot (row 0) reads the reserved padding page


# ---------------------------------------------------------------- the kernel calls, against FA's contract

def _fa_contract(q, k_cache, v_cache, lens, page_table, cu_q, scale, causal, window, softcap, unbounded):
    """float64 FlashAttention semantics over a paged cache (the stand-ins below adapt the two signatures)."""
    assert causal is True
    ps = k_cache.shape[1]
    outs = []
    bs = page_table.shape[0]
    for b in range(bs):
        qb = q[b] if cu_q is None else q[int(cu_q[b]):int(cu_q[b + 1])]
        n_k = int(lens[b])
        slots = torch.tensor([int(page_table[b, j // ps]) * ps + j % ps for j in range(n_k)], dtype=torch.long)
        kb = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()
        vb = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        group = qb.shape[1] // kb.shape[1]
        s = torch.einsum("qhd,khd->hqk", qb.double(), kb.repeat_interleave(group, 1)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(qb.shape[0])[:, None] + (n_k - qb.shape[0])  # bottom-right aligned query positions
        j = torch.arange(n_k)[None, :]
        mask = j <= i + (0 if window[1] in (None, unbounded) else window[1])
        if window[0] not in (None, unbounded):
            mask &= j >= i - window[0]
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vb.repeat_interleave(group, 1)))
    out = torch.cat(outs) if cu_q is not None else torch.stack(outs)
    return out.to(q.dtype), None  # (out, lse): both kernels may return a tuple


def fa4_standin(q, k, v, *, cu_seqlens_q=None, max_seqlen_q=None, seqused_k=None, page_table=None,
                softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, num_splits=1):
    """flash_attn.cute.flash_attn_varlen_func's documented paged contract (keyword names as in 4.0.0b36)."""
    assert page_table.dtype == seqused_k.dtype == torch.int32 and num_splits == 1
    assert (cu_seqlens_q is None) == (q.dim() == 4) and (cu_seqlens_q is None or max_seqlen_q is not None)
    return _fa_contract(q, k, v, seqused_k, page_table, cu_seqlens_q, softmax_scale, causal, window_size, softcap,
                        None)


def fa3_standin(q, k_cache, v_cache, *, cache_seqlens=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=None,
                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """flash_attn_interface.flash_attn_with_kvcache's documented paged contract (-1 = unbounded window)."""
    assert page_table.dtype == cache_seqlens.dtype == torch.int32
    assert (cu_seqlens_q is None) == (q.dim() == 4)
    out, _ = _fa_contract(q, k_cache, v_cache, cache_seqlens, page_table, cu_seqlens_q, softmax_scale, causal,
                          window_size, softcap, -1)
    return out


STEPS = [("extend", [40, 7, 1]), ("decode", [1, 1, 1]), ("mixed", [1, 20, 1]), ("decode", [1, 1, 1])]


@pytest.mark.parametrize("name", ["fa3", "fa4"])
@pytest.mark.parametrize("page,window,cap", [(16, None, 0.0), (128, 9, 0.0), (1, None, 20.0), (16, 30, 10.0)])
def test_backend_calls_match_float64_through_the_fa_contract(monkeypatch, name, page, window, cap) -> None:
    from triton_interpreted.paged import make_paged_cache, reference_attention, step_batch

    monkeypatch.setattr(PagedFlashBackend, "_check_context", lambda self, ctx: None)  # CPU: no GPU checks
    cls = find(name, "llm", "mha").load()
    hq, hkv, dim = 4, 2, 16
    prefix = [0, 130, 37]
    total = [p + sum(s[1][i] for s in STEPS) for i, p in enumerate(prefix)]
    cache = make_paged_cache(total, page, hkv, dim, torch.float32, fill=prefix, seed=page)
    ctx = BackendContext(torch.device("cpu"), torch.float32, hq, hkv, dim, page, cache.r2t, cache.pool)
    backend = cls(ctx, kernel=fa3_standin if name == "fa3" else fa4_standin)
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5, sliding_window=window, logit_cap=cap)
    gen = torch.Generator().manual_seed(2)
    lo = list(prefix)
    for step, new in STEPS:
        mode = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE, "mixed": ForwardMode.MIXED}[step]
        hi = [a + n for a, n in zip(lo, new)]
        batch = step_batch(cache, mode, lo, new)
        q = torch.randn(sum(new), hq, dim, generator=gen)
        k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_keys, lo, hi)])
        v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_values, lo, hi)])
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, layer, batch)
        assert out.shape == (sum(new), hq, dim)
        row = 0
        for i, (a, b) in enumerate(zip(lo, hi)):
            ref = reference_attention(q[row:row + b - a], cache.keys[i][:b], cache.values[i][:b],
                                      torch.arange(a, b), layer.scaling, window, cap)
            torch.testing.assert_close(out[row:row + b - a].double(), ref, atol=1e-5, rtol=0, msg=f"{step} {i}")
            row += b - a
        lo = hi


# ---------------------------------------------------------------- errors and rules

def test_constructing_on_cpu_is_a_clear_error() -> None:
    r2t = ReqToTokenPool(2, 256)
    pool = TokenKVPool(256, 128, 1, 2, 64, torch.bfloat16)
    for name in ("fa3", "fa4"):
        ctx = BackendContext(torch.device("cpu"), torch.bfloat16, 4, 2, 64, 128, r2t, pool)
        with pytest.raises(BackendUnavailableError, match=f"attention backend {name}: runs on NVIDIA GPUs only, "
                                                          "and the device is cpu; use --attention-backend triton"):
            find(name, "llm", "mha").load()(ctx)


def test_missing_kernel_names_every_module_tried() -> None:
    from sglx.attention.optional_kernels import load_kernel

    with pytest.raises(BackendUnavailableError) as info:
        load_kernel(("no_such_fa_module", "another_missing"), "flash_attn_with_kvcache", "fa3", "--attention-backend x")
    msg = str(info.value)
    assert msg.startswith("attention backend fa3: no_such_fa_module failed to import (ModuleNotFoundError")
    assert "another_missing failed to import" in msg and msg.endswith("; use --attention-backend x")


def _h100(*packages: str):  # type: ignore[no-untyped-def]
    return fake("cuda", packages=("triton", "flash_attn.cute", "flashinfer", *packages), **H100)


BF16 = ModelTraits(dtype="bfloat16", head_dim=128)


def test_fa4_auto_page_size_is_128_on_sm90_and_any_other_size_is_refused() -> None:
    sel = select_llm(_h100(), BF16, LLMBackendArgs(attention_backend="fa4"))
    assert (sel.prefill, sel.decode, sel.page_size) == ("fa4", "fa4", 128)
    with pytest.raises(BackendUnavailableError) as info:
        select_llm(_h100(), BF16, LLMBackendArgs(attention_backend="fa4", page_size=64))
    msg = str(info.value)
    assert "page size 64 is not supported: fa4 needs --page-size 128 on NVIDIA H100" in msg
    assert "Backends that would run here:" in msg
    b200 = fake("cuda", gpu="NVIDIA B200", capability=(10, 0), cuda="13.0", packages=("flash_attn.cute",))
    assert select_llm(b200, BF16, LLMBackendArgs(attention_backend="fa4", page_size=16)).page_size == 16


@pytest.mark.parametrize("prefill,decode,page,graphs", [
    ("fa4", "triton", 128, True), ("triton", "fa4", 128, True), ("fa4", "torch_native", 128, False),
    ("torch_native", "fa4", 128, True), ("fa4", "flex_attention", 128, False),
])
def test_hybrid_pairs_combine_page_rules_and_graphs_follow_decode(prefill, decode, page, graphs) -> None:
    sel = select_llm(_h100(), BF16, LLMBackendArgs(prefill_attention_backend=prefill,
                                                   decode_attention_backend=decode))
    assert (sel.prefill, sel.decode, sel.page_size, sel.hybrid) == (prefill, decode, page, True)
    assert find(decode, "llm", "mha").features.cuda_graph is graphs  # what cuda_graph_plan reads


def test_hybrid_page_size_conflicts_are_one_clear_error(monkeypatch) -> None:
    import dataclasses

    from sglx.attention import registry

    trtllm = find("trtllm_mha", "llm", "mha")
    if not trtllm.implemented:  # the rule under test is the page-size merge, whatever trtllm_mha's progress
        monkeypatch.setitem(registry._REGISTRY, trtllm.key, dataclasses.replace(trtllm, factory="tests.dummy:B"))
    with pytest.raises(BackendUnavailableError, match="page sizes do not overlap.*fa4 needs --page-size 128.*"
                                                      "trtllm_mha needs --page-size 16, 32, 64"):
        select_llm(_h100(), BF16, LLMBackendArgs(prefill_attention_backend="fa4",
                                                 decode_attention_backend="trtllm_mha"))
    with pytest.raises(BackendUnavailableError, match="--prefill-attention-backend fa4 cannot run here"):
        select_llm(_h100(), BF16, LLMBackendArgs(prefill_attention_backend="fa4", decode_attention_backend="triton",
                                                 page_size=16))


def test_hybrid_fa4_prefill_with_inherited_decode_backend() -> None:
    sel = select_llm(_h100(), BF16, LLMBackendArgs(attention_backend="triton", prefill_attention_backend="fa4"))
    assert (sel.prefill, sel.decode, sel.page_size) == ("fa4", "triton", 128)
    assert "--prefill-attention-backend fa4; the other phase inherits" in sel.why


def test_engine_refuses_fa4_before_weights_load_on_cpu(monkeypatch) -> None:
    from sglx.llm import models
    from sglx.llm.engine_config import EngineConfig
    from sglx.llm.model_runner import ModelRunner

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights loaded before selection"))
    cfg = EngineConfig(model_path="llama-3.2-1b", load_format="dummy", device="cpu", attention_backend="fa4")
    with pytest.raises(BackendUnavailableError, match="--attention-backend fa4 cannot run here"):
        ModelRunner(cfg)


def test_doctor_explains_fa3_and_fa4() -> None:
    from sglx.doctor import build_report

    def rows(snap):  # type: ignore[no-untyped-def]
        mha = next(s for s in build_report(snap, "llm")["sections"] if s["kind"] == "mha")
        return {r["name"]: r for r in mha["backends"]}

    bare = rows(fake("cuda", packages=("triton",), **H100))
    assert any("flash_attn.cute is not installed" in r and "sglx[fa]" in r for r in bare["fa4"]["reasons"])
    assert any("flash_attn_interface or sgl_kernel is not installed" in r and "535 MB" in r
               for r in bare["fa3"]["reasons"])
    ready = rows(_h100())
    assert ready["fa4"]["usable"] and ready["fa4"]["page_sizes"] == [128] and ready["fa4"]["cuda_graph"]
    a100 = rows(fake("cuda", gpu="NVIDIA A100", capability=(8, 0), cuda="12.4", packages=("flash_attn.cute",)))
    assert any("needs compute capability 9.0, 10.x" in r for r in a100["fa4"]["reasons"])


# ---------------------------------------------------------------- a whole model through the calls, vs HF

@pytest.mark.usefixtures("single_torch_thread")
def test_tiny_mistral_through_fa4_prefill_and_fa3_decode_matches_hf(monkeypatch, tmp_path) -> None:
    """Hybrid (fa4 calls for prefill, fa3 calls for decode, stand-in kernels) on a sliding-window model vs HF."""
    from llm_test_utils import PagedKVHarness, hf_greedy, load_hf_model, make_tiny_model
    from sglx.attention.llm.fa3 import FA3Backend
    from sglx.attention.llm.fa4 import FA4Backend
    from sglx.attention.llm.hybrid import HybridAttentionBackend
    from sglx.llm.models import load_model
    from sglx.llm.tokenizer import Tokenizer

    monkeypatch.setattr(PagedFlashBackend, "_check_context", lambda self, ctx: None)
    path = make_tiny_model(tmp_path, "mistral")  # sliding window 8
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Radix trees share the prefix of prompts.")]
    harness = PagedKVHarness(model, page_size=16)
    ctx = harness.backend.ctx
    harness.backend = HybridAttentionBackend(ctx, FA4Backend(ctx, kernel=fa4_standin),
                                             FA3Backend(ctx, kernel=fa3_standin))
    rows = [harness.new_request() for _ in prompts]
    steps = 6
    refs = [hf_greedy(hf, p, steps) for p in prompts]
    logits = harness.extend(list(zip(rows, prompts)))
    tokens = [[int(t)] for t in logits.argmax(-1)]
    for step in range(1, steps):
        for i, (_, ref_logits) in enumerate(refs):
            torch.testing.assert_close(logits[i], ref_logits[step - 1], atol=1e-4, rtol=1e-4)
        logits = harness.decode([(row, toks[-1]) for row, toks in zip(rows, tokens)])
        for toks, t in zip(tokens, logits.argmax(-1).tolist()):
            toks.append(t)
    assert tokens == [ref[:steps] for ref, _ in refs]


def test_sm90_page_rule_does_not_apply_off_gpu() -> None:
    """On a CPU, fa4's reasons are the platform and package ones, never an SM90 page rule ("on None")."""
    from sglx.attention.registry import availability
    from sglx.attention.request import AttentionRequest

    reasons = availability(find("fa4", "llm", "mha"), fake("cpu"), AttentionRequest(page_size=16)).reasons
    assert any("runs on CUDA only" in r for r in reasons)
    assert not any("page size" in r for r in reasons)
    h100 = availability(find("fa4", "llm", "mha"), _h100(), AttentionRequest(page_size=16)).reasons
    assert h100 == ("page size 16 is not supported: fa4 needs --page-size 128 on NVIDIA H100 80GB HBM3",)
