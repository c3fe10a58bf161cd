"""The fa4 MLA backend on CPU, with a float64 stand-in of `flash_attn.cute.flash_attn_varlen_func`.

FA4 runs only on an SM90/SM100 GPU (tests/gpu/test_mla_gpu.py judges the real prefill kernel on the lent H200; its
absorbed decode needs Blackwell, which is never lent). Here a stand-in with FA4's documented MLA contract (4.0.0b36:
ragged K/V through cu_seqlens_k, or the absorbed form O = softmax(scale (q k^T + qv v^T)) v over pages through
page_table / seqused_k; causal aligned to the END of each request's keys; the shape checks its interface makes)
checks what sglx hands it, against the float64 expanded-latent reference and against transformers' logits: a wrong
slot order, offset, causal alignment, page view or absorption fails here. Selection, doctor and the error when a
user asks Hopper for fa4 MLA decode are checked from the registry.
"""

from __future__ import annotations

import pytest
import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.fa4_mla import FA4MLABackend
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
from sglx.attention.llm.paged_latents import PagedLatents
from sglx.attention.selection import LLMBackendArgs, ModelTraits, select_llm
from sglx.errors import BackendUnavailableError
from sglx.llm.forward_batch import ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.mla_kv_cache import MLATokenKVPool
from sglx.platform import fake

H, DN, DR, DV, R = 2, 16, 64, 24, 512  # FA4's absorbed kernels take only DeepSeek's latent: 512 + 64
SPEC = MLALayerSpec(1, H, DN, DR, DV, R, 0.6 * (DN + DR) ** -0.5)
H100 = dict(gpu="NVIDIA H100 80GB HBM3", capability=(9, 0), cuda="13.0")
B200 = dict(gpu="NVIDIA B200", capability=(10, 0), cuda="13.0")
MLA = ModelTraits(mla=True, dtype="bfloat16", head_dim=576)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


class FA4Calls:
    """The stand-in's record of every call: (form, tokens or batch size) per call."""

    log: list[tuple[str, int]] = []


def _causal_attention(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """scores [H, q, k] (query i at position k - q + i, FA's bottom-right alignment), values [k, H, dv] or [k, dv]."""
    q_len, k_len = scores.shape[-2:]
    q_pos = torch.arange(q_len)[:, None] + (k_len - q_len)
    probs = torch.softmax(scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf")), -1)
    if values.dim() == 3:
        return torch.einsum("hqk,khd->qhd", probs, values)
    return torch.einsum("hqk,kd->qhd", probs, values)


def fa4_standin(q, k, v, qv=None, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                seqused_k=None, page_table=None, softmax_scale=None, causal=False, num_splits=1):
    """flash_attn.cute.flash_attn_varlen_func (4.0.0b36) as documented, in float64: keyword names as FA4's, so a
    misspelt argument is a TypeError."""
    assert causal is True and softmax_scale is not None
    assert all(t is None or t.stride(-1) == 1 for t in (q, k, v, qv)), "FA4 copies non-contiguous inputs"
    assert q.dtype == k.dtype == v.dtype and (qv is None or qv.dtype == v.dtype)
    if page_table is None:  # ragged: cu_seqlens over packed queries and keys
        assert qv is None and seqused_k is None
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and cu_seqlens_q.shape == cu_seqlens_k.shape
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert (q.shape[0], k.shape[0]) == (cq[-1], ck[-1]) and k.shape[:2] == v.shape[:2] and k.shape[1] == q.shape[1]
        assert cq[0] == ck[0] == 0 and max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
        FA4Calls.log.append(("ragged", q.shape[0]))
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        for i in range(len(cq) - 1):
            qi, ki, vi = q[cq[i]:cq[i + 1]].double(), k[ck[i]:ck[i + 1]].double(), v[ck[i]:ck[i + 1]].double()
            out[cq[i]:cq[i + 1]] = _causal_attention(torch.einsum("qhd,khd->hqk", qi, ki) * softmax_scale, vi)
        return out.to(q.dtype), None
    # absorbed MLA over pages: q = q_pe, k = k_pe pages, v = c_kv pages, qv = q_nope W_UK
    assert cu_seqlens_k is None and cu_seqlens_q is None and qv is not None and num_splits == 1
    assert page_table.dtype == seqused_k.dtype == torch.int32 and page_table.stride(-1) == 1
    bs, seqlen_q, heads, _ = q.shape
    num_pages, page_size = v.shape[:2]
    assert (q.shape[-1], v.shape[-1]) == (64, 512) and qv.shape == (bs, seqlen_q, heads, 512)
    assert k.shape == (num_pages, page_size, 1, 64) and v.shape == (num_pages, page_size, 1, 512)
    assert page_table.shape[0] == bs and seqused_k.shape == (bs,)
    FA4Calls.log.append(("absorbed", bs))
    out = torch.empty(bs, seqlen_q, heads, 512, dtype=torch.float64)
    for b in range(bs):
        n = int(seqused_k[b])
        slots = [int(page_table[b, j // page_size]) * page_size + j % page_size for j in range(n)]
        kb = k.reshape(-1, 64)[slots].double()
        vb = v.reshape(-1, 512)[slots].double()
        scores = (torch.einsum("qhd,kd->hqk", q[b].double(), kb)
                  + torch.einsum("qhd,kd->hqk", qv[b].double(), vb)) * softmax_scale
        out[b] = _causal_attention(scores, vb)
    return out.to(q.dtype), None


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FA4MLABackend, "_check_context", lambda self, ctx: None)  # CPU: no GPU checks
    FA4Calls.log = []


def _paged_requests(prefix: list[int], totals: list[int], page: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    paged = PagedLatents.build(prefix, totals, page, R, DR, torch.float32, "cpu", gen, layer_id=SPEC.layer_id,
                               num_layers=2)
    proj = MLAProjections.from_kv_b_proj(torch.randn(H * (DN + DV), R, generator=gen) * R ** -0.5, SPEC)
    return gen, paged, proj


STEPS = [(ForwardMode.EXTEND, [21, 6, 1]), (ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.MIXED, [1, 4, 1]),
         (ForwardMode.DECODE, [1, 1, 1])]


@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("budget", [None, 1], ids=["one-call", "a-call-per-request"])
def test_fa4_mla_calls_match_float64(on_cpu: None, page: int, budget: int | None) -> None:
    """Extend over cached prefixes (the expanded form, ragged), decode (the absorbed form over pages) and mixed steps
    on shuffled pages; with a 1-byte expansion budget every request is its own ragged call."""
    prefix = [0, 13, 37]
    totals = [p + sum(n[i] for _, n in STEPS) for i, p in enumerate(prefix)]
    gen, paged, proj = _paged_requests(prefix, totals, page, seed=page)
    ctx = BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, page, paged.r2t, paged.pool)
    backend = FA4MLABackend(ctx, kernel=fa4_standin, absorbed_decode=True)
    if budget is not None:
        backend.max_expanded_bytes = budget
    lo = list(prefix)
    for mode, new in STEPS:
        hi = [a + n for a, n in zip(lo, new)]
        q_nope = torch.randn(sum(new), H, DN, generator=gen)
        q_pe = torch.randn(sum(new), H, DR, generator=gen)
        fresh = paged.new_latents(lo, hi)
        batch = paged.step(mode, lo, hi, backend)
        FA4Calls.log = []
        backend.init_forward_metadata(batch)
        out = backend.forward_mla(q_nope, q_pe, fresh[:, :R], fresh[:, R:], SPEC, proj, batch)
        assert out.shape == (sum(new), H, DV)
        if mode.is_decode:
            assert FA4Calls.log == [("absorbed", 3)]
        else:
            assert FA4Calls.log == ([("ragged", sum(new))] if budget is None else [("ragged", n) for n in new])
        ref = paged.reference(q_nope, q_pe, lo, hi, proj, SPEC.scaling)
        for i, (got, want) in enumerate(zip(out.split(new), ref.split(new), strict=True)):
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0, msg=f"{mode} request {i}")
        lo = hi


def test_fa4_mla_decode_graph_buffers_equal_eager(on_cpu: None) -> None:
    """Decode through the captured-graph metadata (fixed page-table and length buffers, refilled from the graph's
    static inputs) gives the eager step's output."""
    page, prefix = 16, [40, 3, 77]
    hi = [p + 1 for p in prefix]
    gen, paged, proj = _paged_requests(hi, hi, page, seed=5)  # this step's latents stored too
    ctx = BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, page, paged.r2t, paged.pool)
    backend = FA4MLABackend(ctx, kernel=fa4_standin, absorbed_decode=True)
    fresh = paged.new_latents(prefix, hi)
    q_nope, q_pe = torch.randn(3, H, DN, generator=gen), torch.randn(3, H, DR, generator=gen)
    batch = paged.step(ForwardMode.DECODE, prefix, hi, backend)
    backend.init_forward_metadata(batch)
    eager = backend.forward_mla(q_nope, q_pe, fresh[:, :R], fresh[:, R:], SPEC, proj, batch, save_kv_cache=False)
    backend.init_cuda_graph_state(4, 4)
    static_rows, static_lens = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long)
    backend.init_forward_metadata_capture_cuda_graph(3, static_rows[:3], static_lens[:3])
    static_rows[:3], static_lens[:3] = torch.tensor(paged.rows), torch.tensor(hi)
    backend.init_forward_metadata_replay_cuda_graph(3, static_rows[:3], static_lens[:3], hi)
    backend.init_forward_metadata_in_graph(3)
    replay = backend.forward_mla(q_nope, q_pe, fresh[:, :R], fresh[:, R:], SPEC, proj, batch, save_kv_cache=False)
    torch.testing.assert_close(replay, eager, atol=0, rtol=0)


def test_fa4_mla_decode_without_blackwell_is_a_clear_error(on_cpu: None) -> None:
    _, paged, proj = _paged_requests([4], [5], 1, seed=0)
    backend = FA4MLABackend(BackendContext(torch.device("cpu"), torch.float32, H, 1, R + DR, 1, paged.r2t,
                                           paged.pool), kernel=fa4_standin, absorbed_decode=False)
    batch = paged.step(ForwardMode.DECODE, [4], [5], backend)
    backend.init_forward_metadata(batch)
    with pytest.raises(BackendUnavailableError, match="Blackwell .*--prefill-attention-backend fa4 "
                                                      "--decode-attention-backend triton"):
        backend.forward_mla(torch.zeros(1, H, DN), torch.zeros(1, H, DR), torch.zeros(1, R), torch.zeros(1, DR),
                            SPEC, proj, batch)
    assert FA4Calls.log == []


def test_fa4_mla_construction_errors() -> None:
    r2t = ReqToTokenPool(2, 64)
    cpu = BackendContext(torch.device("cpu"), torch.bfloat16, H, 1, R + DR, 1, r2t,
                         MLATokenKVPool(64, 1, 1, R, DR, torch.bfloat16))
    with pytest.raises(BackendUnavailableError, match="attention backend fa4: runs on NVIDIA GPUs only, and the "
                                                      "device is cpu; use --attention-backend triton"):
        FA4MLABackend(cpu, kernel=fa4_standin)


# ---------------------------------------------------------------- selection and doctor, from the registry

def _gpu(kind: dict, *packages: str):  # type: ignore[no-untyped-def]
    return fake("cuda", packages=("triton", "flash_attn.cute", *packages), **kind)


def test_hopper_runs_fa4_mla_prefill_and_refuses_its_decode() -> None:
    sel = select_llm(_gpu(H100), MLA, LLMBackendArgs(prefill_attention_backend="fa4",
                                                     decode_attention_backend="triton"))
    assert (sel.prefill, sel.decode, sel.hybrid) == ("fa4", "triton", True)
    sel = select_llm(_gpu(H100), MLA, LLMBackendArgs(prefill_attention_backend="fa4"))  # decode: auto
    assert sel.prefill == "fa4" and sel.decode != "fa4"
    for args in (LLMBackendArgs(attention_backend="fa4"), LLMBackendArgs(decode_attention_backend="fa4"),
                 LLMBackendArgs(attention_backend="fa4", prefill_attention_backend="triton")):
        with pytest.raises(BackendUnavailableError) as info:
            select_llm(_gpu(H100), MLA, args)
        msg = str(info.value)
        assert "cannot run here" in msg and "its decode needs compute capability 10.x, this GPU (NVIDIA H100 80GB " \
               "HBM3) is 9.0 (flash-attn-4's absorbed MLA kernels (qv) are Blackwell-only)" in msg, msg
    with pytest.raises(BackendUnavailableError, match="its prefill runs here: --prefill-attention-backend fa4"):
        select_llm(_gpu(H100), MLA, LLMBackendArgs(attention_backend="fa4"))
    # --attention-backend fa4 with a decode flag serves prefill only: it runs
    sel = select_llm(_gpu(H100), MLA, LLMBackendArgs(attention_backend="fa4", decode_attention_backend="triton"))
    assert (sel.prefill, sel.decode) == ("fa4", "triton")


def test_blackwell_runs_fa4_mla_for_both_phases_at_the_deepseek_latent_only() -> None:
    sel = select_llm(_gpu(B200), MLA, LLMBackendArgs(attention_backend="fa4", page_size=64))
    assert (sel.prefill, sel.decode, sel.page_size) == ("fa4", "fa4", 64)
    odd = ModelTraits(mla=True, dtype="bfloat16", head_dim=96)  # a latent FA4's absorbed kernels do not take
    with pytest.raises(BackendUnavailableError, match="its decode MLA latent dim .* 96 is not supported: needs one "
                                                      "of 576"):
        select_llm(_gpu(B200), odd, LLMBackendArgs(attention_backend="fa4"))
    assert select_llm(_gpu(B200), odd, LLMBackendArgs(prefill_attention_backend="fa4",
                                                      decode_attention_backend="triton")).prefill == "fa4"
    with pytest.raises(BackendUnavailableError, match="fp8 KV cache"):
        select_llm(_gpu(B200), MLA, LLMBackendArgs(attention_backend="fa4", kv_cache_dtype="fp8_e4m3"))


def test_doctor_shows_fa4_mla_as_prefill_only_on_hopper() -> None:
    from sglx.doctor import build_report

    def fa4_row(snap):  # type: ignore[no-untyped-def]
        mla = next(s for s in build_report(snap, "llm")["sections"] if s["kind"] == "mla")
        return next(r for r in mla["backends"] if r["name"] == "fa4")

    hopper = fa4_row(_gpu(H100))
    assert hopper["implemented"] and not hopper["usable"] and hopper["prefill_only"]
    assert any("Blackwell-only" in r for r in hopper["reasons"])
    blackwell = fa4_row(_gpu(B200))
    assert blackwell["usable"] and not blackwell["prefill_only"] and blackwell["cuda_graph"]
    bare = fa4_row(fake("cuda", packages=("triton",), **H100))
    assert not bare["usable"] and not bare["prefill_only"]
    assert any("flash_attn.cute is not installed" in r for r in bare["reasons"])


# ---------------------------------------------------------------- a whole model through the calls, vs transformers

@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_tiny_deepseek_through_fa4_calls_matches_hf(on_cpu: None, tmp_path, arch: str) -> None:
    """A tiny DeepSeek with the real latent (512 + 64) on pages of 4: prefill and a cached-prefix extend through the
    ragged calls, decode through the absorbed calls; logits and greedy tokens equal transformers'."""
    from llm_test_utils import PagedKVHarness, hf_greedy, load_hf_model, make_tiny_model
    from sglx.llm.models import load_model
    from sglx.llm.tokenizer import Tokenizer

    path = make_tiny_model(tmp_path, arch, kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64, num_attention_heads=4,
                           num_key_value_heads=4)
    model, _ = load_model(path, torch.float32, "cpu")
    hf = load_hf_model(path)
    tok = Tokenizer.from_dir(path)
    first = tok.encode("Attention reads keys and values through a table that maps positions to slots.")
    second = first[:12] + tok.encode("The quick brown fox")[1:]
    harness = PagedKVHarness(model, page_size=4)
    harness.backend = FA4MLABackend(harness.backend.ctx, kernel=fa4_standin, absorbed_decode=True)
    row_a = harness.new_request()
    ours = harness.extend([(row_a, first)], return_all_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([first])).logits[0].float(), atol=1e-4, rtol=1e-4)
    row_b = harness.new_request(share_from=row_a, shared_len=12)  # a cached prefix of 12 tokens
    last = harness.extend([(row_b, second[12:])])
    tokens = [int(last.argmax(-1)[0])]
    for _ in range(7):
        tokens.append(int(harness.decode([(row_b, tokens[-1])]).argmax(-1)[0]))
    assert tokens == hf_greedy(hf, second, 8)[0]
    assert {form for form, _ in FA4Calls.log} == {"ragged", "absorbed"}
