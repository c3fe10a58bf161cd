"""MLA on a real GPU: the triton MLA decode kernel at DeepSeek-V3 shapes vs float64, the flashinfer MLA backend vs
float64 (page size 1, extend over cached prefixes, decode, mixed), the triton, flashinfer and torch_native MLA backends
and CUDA graphs on tiny DeepSeek models vs transformers, the fused Triton MoE vs the per-expert loop, doctor --check's
MLA problem per backend, and a dummy DeepSeek-V2-Lite one-batch step.

Run on the lent machine (FlashInfer from the wheels in /work/shared/DEVICE.md; without it those tests skip):
PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_mla_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

DEV = "cuda"
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("launch", ["default", "wide", "tl_dot", "seesaw"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,page,heads", [(torch.bfloat16, 1, 128), (torch.bfloat16, 64, 16),
                                              (torch.float16, 16, 128)])
@pytest.mark.parametrize("batch", [4, 64])
def test_mla_decode_kernel_real_shapes_match_float64(dtype, page, heads, kv_cache_dtype, launch, batch):
    """Latent 512 + rope 64, ragged contexts up to 3000 keys on scattered pages, several splits (batch 4) or one
    (batch 64 with 128 heads); "wide": the 64-head launch on fp8 latents (bf16 with 64+ heads gets it by default);
    "tl_dot": the 64-head launch without the Gluon kernel (the default takes it on SM90, 16-bit or fp8 latents);
    "seesaw": the warp-specialised Gluon kernel (16-bit latents)."""
    from sglx.attention.kernels.common import num_sms
    from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr
    from sglx.attention.kernels.mla_decode import (
        MLADecodeConfig,
        mla_decode_attention,
        mla_num_splits,
        resolve_config,
        use_gluon,
        wide_launch,
    )

    if launch == "wide" and (kv_cache_dtype == "auto" or heads < 64):
        pytest.skip("the default launch already is the wide one, or too few heads for it")
    if launch == "tl_dot" and heads < 64:
        pytest.skip("no Gluon kernel to leave out")
    if launch == "seesaw" and (heads < 64 or kv_cache_dtype != "auto" or not triton_verifies_gluon()):
        pytest.skip("the seesaw kernel takes 16-bit latents, 64+ heads and SM90 with a verified Triton")
    if batch == 64 and (heads < 64 or page != 1):
        pytest.skip("one split needs 64+ heads; one page size is enough")
    from sglx.llm.kv_cache import ReqToTokenPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    r, dr, lens = 512, 64, [1, 700, 3000, 129] if batch == 4 else [1, 700, 3000, 129] + [64 * i + 5 for i in range(60)]
    gen = torch.Generator().manual_seed(page)
    num_slots = (sum(-(-n // page) for n in lens) + 2) * page
    r2t = ReqToTokenPool(len(lens) + 1, max(lens) + page, DEV)
    pool = MLATokenKVPool(num_slots, page, 1, r, dr, dtype, kv_cache_dtype, DEV)
    pages = (torch.randperm(num_slots // page, generator=gen) + 1).tolist()
    rows = []
    for n in lens:
        row = r2t.alloc()
        mine = [pages.pop() for _ in range(-(-n // page))]
        slots = torch.tensor([p * page + j for p in mine for j in range(page)][:n], device=DEV)
        r2t.req_to_token[row, :n] = slots.int()
        lat = torch.randn(n, r + dr, generator=gen).to(DEV, dtype)
        pool.set_latent(0, slots, lat[:, :r], lat[:, r:])
        rows.append(row)
    kv_indptr = build_kv_indptr(torch.tensor(lens, dtype=torch.int32, device=DEV))
    kv_indices = torch.empty(sum(lens), dtype=torch.int32, device=DEV)
    build_kv_indices(r2t.req_to_token, torch.tensor(rows, device=DEV), kv_indptr, kv_indices)
    base = {"wide": wide_launch(), "tl_dot": MLADecodeConfig(gluon=False),
            "seesaw": MLADecodeConfig(seesaw=True)}.get(launch, MLADecodeConfig())
    config = resolve_config(base, heads, pool.is_fp8, torch.device(DEV))  # default: what the backend launches
    splits = mla_num_splits(len(lens), heads, max(lens), num_sms(torch.device(DEV)), config)
    assert (splits > 1) == (batch == 4)  # four requests never fill the GPU: the split merge is exercised too
    q = torch.randn(len(lens), heads, r + dr, generator=gen).to(DEV, dtype)
    gluon = use_gluon(q[..., :r], pool.kv_buffer[0], r, dr, config, pool.fp8_dtype)
    assert gluon == (launch != "tl_dot" and heads >= 64 and triton_verifies_gluon())
    out = torch.empty(len(lens), heads, r, dtype=dtype, device=DEV)
    mid_o = torch.empty(len(lens), heads, splits, r, dtype=torch.float32, device=DEV)
    mid_lse = torch.empty(len(lens), heads, splits, dtype=torch.float32, device=DEV)
    scale = (128 + 64) ** -0.5
    mla_decode_attention(q, pool.kv_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_lse, scale, r,
                         kv_scale=pool.kv_scale[0], fp8_dtype=pool.fp8_dtype, config=config)
    for i, n in enumerate(lens):
        lat = pool.get_latent(0, r2t.req_to_token[rows[i], :n].long(), torch.float64)
        ref = torch.softmax(torch.einsum("hd,ld->hl", q[i].double(), lat) * scale, -1) @ lat[:, :r]
        assert (out[i].double() - ref).abs().max().item() < TOL[dtype], i


@pytest.mark.parametrize("single", [False, True])
def test_e4m3_latents_near_zero_keep_their_relative_accuracy(single: bool) -> None:
    """bf16 queries over e4m3 latents take the bit-moved route (FMT 3: latents at 2**-120 of their values, q and the
    weights lifted by 2**64). Latents of size ~2**-7 make 94% of the codes e4m3 subnormals (bfloat16 subnormals once
    moved): the error is measured relative to the output's size, against float64 on the stored values, with the
    split merge (4 requests) and one split (64 requests). A route that lost subnormal codes fails it. (Session 22,
    H200: the same kernel without the 2**64 lifts also passed, so this GPU's wgmma keeps float32 subnormal products;
    the lifts stay, as in decode's bits_k, for hardware that flushes them.)"""
    from sglx.attention.kernels.common import num_sms
    from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention, mla_num_splits, resolve_config
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    r, dr, heads, ctx = 512, 64, 128, 900
    batch = 64 if single else 4
    gen = torch.Generator().manual_seed(3)
    pool = MLATokenKVPool(batch * ctx + 2, 1, 1, r, dr, torch.bfloat16, "fp8_e4m3", DEV)
    slots = (torch.randperm(batch * ctx, generator=gen) + 1).to(DEV)
    lat = (torch.randn(batch * ctx, r + dr, generator=gen) * 2.0 ** -7).to(DEV, torch.bfloat16)
    pool.set_latent(0, slots, lat[:, :r], lat[:, r:])
    codes = pool.kv_buffer[0][slots, 0]
    assert ((codes & 0x78) == 0).float().mean().item() > 0.5  # most codes have a zero exponent field: subnormal
    kv_indptr = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * ctx
    kv_indices = slots.int()
    q = (torch.randn(batch, heads, r + dr, generator=gen) * 30).to(DEV, torch.bfloat16)
    config = resolve_config(MLADecodeConfig(), heads, True, torch.device(DEV))
    splits = mla_num_splits(batch, heads, ctx, num_sms(torch.device(DEV)), config)
    assert (splits == 1) == single
    out = torch.empty(batch, heads, r, dtype=torch.bfloat16, device=DEV)
    mid_o = torch.empty(batch, heads, splits, r, device=DEV)
    mla_decode_attention(q, pool.kv_buffer[0], out, kv_indptr, kv_indices, mid_o, mid_o[..., 0].clone(),
                         (128 + 64) ** -0.5, r, kv_scale=pool.kv_scale[0], fp8_dtype=pool.fp8_dtype, config=config)
    stored = pool.get_latent(0, slots.long(), torch.float64).view(batch, ctx, r + dr)
    probs = torch.softmax(torch.einsum("bhd,bld->bhl", q.double(), stored) * (128 + 64) ** -0.5, -1)
    ref = probs @ stored[..., :r]
    assert probs.max().item() < 0.9  # the weights are spread: many latents matter
    err = ((out.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    assert err < 2e-2, err


@pytest.mark.parametrize("batch", [4, 64])
@pytest.mark.parametrize("seesaw", [False, True])
def test_gluon_mla_decode_replays_in_a_cuda_graph(batch: int, seesaw: bool) -> None:
    """The Gluon stage 1 (and the merge, batch 4) captured in a CUDA graph and replayed on new inputs equals eager."""
    from sglx.attention.kernels.common import num_sms
    from sglx.attention.kernels.mla_decode import MLADecodeConfig as Config
    from sglx.attention.kernels.mla_decode import mla_decode_attention, mla_num_splits, resolve_config, use_gluon

    if not triton_verifies_gluon():
        pytest.skip("the Gluon MLA kernel is not the default here (SM90 with a verified Triton)")
    r, dr, heads, ctx = 512, 64, 128, 1000
    gen = torch.Generator(device=DEV).manual_seed(batch)
    kv = torch.randn(batch * ctx + 1, 1, r + dr, device=DEV, generator=gen).to(torch.bfloat16)
    kv_indptr = torch.arange(batch + 1, device=DEV, dtype=torch.int32) * ctx
    kv_indices = (torch.randperm(batch * ctx, device=DEV, generator=gen) + 1).int()
    config = resolve_config(Config(seesaw=seesaw), heads, False, torch.device(DEV))
    splits = mla_num_splits(batch, heads, ctx, num_sms(torch.device(DEV)), config)
    q = torch.randn(batch, heads, r + dr, device=DEV, generator=gen).to(torch.bfloat16)
    assert use_gluon(q[..., :r], kv, r, dr, config, None)
    out = torch.empty(batch, heads, r, dtype=torch.bfloat16, device=DEV)
    mid_o = torch.empty(batch, heads, splits, r, dtype=torch.float32, device=DEV)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=DEV)

    def call():
        return mla_decode_attention(q, kv, out, kv_indptr, kv_indices, mid_o, mid_lse, 0.1, r, config=config)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    q.copy_(torch.randn(q.shape, device=DEV, generator=gen).to(torch.bfloat16))
    eager = call().clone()
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager)


def triton_verifies_gluon() -> bool:
    import triton

    from sglx.attention.kernels.mla_decode import GLUON_TRITON

    return torch.cuda.get_device_capability()[0] == 9 and triton.__version__.startswith(GLUON_TRITON)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
    from sglx.llm.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("mla_models")
    out = {}
    for arch in ("deepseek_v2", "deepseek_v3"):
        path = make_tiny_model(root, arch)
        tok = Tokenizer.from_dir(path)
        prompts = [tok.encode(t) for t in ("The quick brown fox", "Attention reads keys and values through a "
                                           "table that maps positions to slots, one page at a time.")]
        hf = load_hf_model(path)
        out[arch] = (path, prompts, [hf_greedy(hf, p, 24)[0] for p in prompts])
    return out


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_engine_on_gpu_matches_hf(deepseek: dict, arch: str, backend: str, page_size: int) -> None:
    """float32 on CUDA: greedy tokens equal transformers' (fused Triton MoE; triton decode replays CUDA graphs)."""
    from sglx.llm.engine import Engine

    path, prompts, refs = deepseek[arch]
    with Engine(model_path=str(path), dtype="float32", device="cuda", attention_backend=backend,
                page_size=page_size, max_total_tokens=4096) as eng:
        assert eng.info["cuda_graph"] == (backend == "triton"), eng.info.get("cuda_graph_why")
        results = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                                   "ignore_eos": True})
    assert [r["output_ids"] for r in results] == refs


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bf16_cuda_graphs_equal_eager(deepseek: dict, arch: str) -> None:
    """bf16: fused-MoE and triton MLA decode replay CUDA graphs; tokens equal eager decode."""
    from sglx.llm.engine import Engine

    path, prompts, _ = deepseek[arch]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                    max_total_tokens=4096, disable_cuda_graph=disable) as eng:
            assert eng.info["cuda_graph"] == (not disable)
            outs.append([r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_triton_mla_prefill_graphs_equal_eager_prefill(deepseek: dict, arch: str) -> None:
    """float32, prompts one at a time (each after the first on a cached prefix: the BOS token, then a whole earlier
    prompt): every prefill replays a graph; tokens equal transformers' and an engine with prefill graphs off."""
    from sglx.llm.engine import Engine

    path, prompts, refs = deepseek[arch]
    ordered = [*prompts, prompts[1] + prompts[0]]  # the last one starts with a cached prompt
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs, replays = [], []
    for limit in (None, 0):
        with Engine(model_path=str(path), dtype="float32", device="cuda", attention_backend="triton",
                    max_total_tokens=4096, cuda_graph_max_prefill_tokens=limit) as eng:
            assert eng.info["prefill_cuda_graph"] == (limit is None), eng.info["prefill_cuda_graph_why"]
            outs.append([eng.generate(input_ids=[p], sampling_params=params)[0]["output_ids"] for p in ordered])
            pg = eng.runner.prefill_graph_runner
            replays.append(pg.replays if pg is not None else 0)
    assert replays == [3, 0]
    assert outs[0] == outs[1]
    assert outs[0][:2] == [r[:12] for r in refs]


def _fa4_prefill_or_skip() -> None:
    from sglx import platform
    from sglx.attention.registry import availability, find
    from sglx.attention.request import AttentionRequest

    verdict = availability(find("fa4", "llm", "mla"), platform.current(), AttentionRequest(kind="mla", phase="prefill"))
    if not verdict.ok:
        pytest.skip(f"fa4 MLA prefill cannot run here: {verdict.reasons}")


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("budget", [None, 1], ids=["one-call", "a-call-per-request"])
@pytest.mark.parametrize("backend_name", ["triton", "fa4"])
@pytest.mark.parametrize("lengths", [([0, 700, 3000, 129], [512, 33, 1, 200]), ([4096, 2000], [512, 3000])],
                         ids=["ragged", "long"])  # long: over 2,048 keys a request (triton's large split-head tile)
def test_mla_extend_real_shapes_match_float64(backend_name: str, page: int, budget: int | None,
                                              lengths: tuple[list[int], list[int]]) -> None:
    """The expanded-latent extend of triton MLA (its 192-wide heads as 128 + 64 tiles) and fa4 MLA (FA4's varlen
    kernel) at DeepSeek-V2-Lite's attention shape (16 heads, nope 128 + rope 64, v 128, latent 512 + 64), bf16, over
    cached prefixes of up to 3,000 keys on scattered pages, against float64; with a 1-byte budget each request is its
    own expansion and call."""
    if backend_name == "fa4":
        _fa4_prefill_or_skip()
    from sglx.attention.llm.base import BackendContext
    from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
    from sglx.attention.llm.paged_latents import PagedLatents
    from sglx.attention.registry import find
    from sglx.llm.forward_batch import ForwardMode

    heads, dn, dr, dv, r, dtype = 16, 128, 64, 128, 512, torch.bfloat16
    spec = MLALayerSpec(0, heads, dn, dr, dv, r, (dn + dr) ** -0.5)
    prefix, new = lengths
    totals = [p + n for p, n in zip(prefix, new)]
    gen = torch.Generator().manual_seed(page)
    paged = PagedLatents.build(prefix, totals, page, r, dr, dtype, DEV, gen)
    proj = MLAProjections.from_kv_b_proj((torch.randn(heads * (dn + dv), r, generator=gen) * r ** -0.5).to(DEV, dtype),
                                         spec)
    backend = find(backend_name, "llm", "mla").load()(BackendContext(torch.device(DEV), dtype, heads, 1, r + dr, page,
                                                                     paged.r2t, paged.pool))
    if budget is not None:
        backend.max_expanded_bytes = budget
    q_nope = torch.randn(sum(new), heads, dn, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(sum(new), heads, dr, generator=gen).to(DEV, dtype)
    fresh = paged.new_latents(prefix, totals)
    batch = paged.step(ForwardMode.EXTEND, prefix, totals, backend)
    backend.init_forward_metadata(batch)
    out = backend.forward_mla(q_nope, q_pe, fresh[:, :r], fresh[:, r:], spec, proj, batch)
    ref = paged.reference(q_nope, q_pe, prefix, totals, proj, spec.scaling)
    for i, (got, want) in enumerate(zip(out.split(new), ref.split(new), strict=True)):
        assert (got.double() - want).abs().max().item() < TOL[dtype], i


def _flashinfer_or_skip() -> None:
    from sglx import platform
    from sglx.attention.registry import availability, find

    verdict = availability(find("flashinfer", "llm", "mla"), platform.current())
    if not verdict.ok:
        pytest.skip(f"flashinfer MLA cannot run here: {verdict.reasons}")


@pytest.mark.parametrize("heads", [16, 128])
def test_flashinfer_mla_backend_matches_float64(heads: int) -> None:
    """The real FlashInfer MLA kernel through the backend, bf16, latent 512 + 64 on shuffled one-token pages:
    extend over cached prefixes (causal, new tokens see the prefix), decode, mixed, decode; two layers per step
    share one plan. float64 reference: every latent expanded per head, causal softmax."""
    from sglx.attention.llm.base import BackendContext
    from sglx.attention.llm.flashinfer_mla import FlashInferMLABackend
    from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
    from sglx.attention.llm.mla_reference import reference_mla
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from sglx.llm.kv_cache import ReqToTokenPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    _flashinfer_or_skip()
    r, dr, dn, dv = 512, 64, 128, 128
    spec = MLALayerSpec(1, heads, dn, dr, dv, r, 0.7 * (dn + dr) ** -0.5)
    gen = torch.Generator().manual_seed(heads)
    prefix = [0, 130, 1000, 7]
    steps = [(ForwardMode.EXTEND, [200, 17, 1, 64]), (ForwardMode.DECODE, [1, 1, 1, 1]),
             (ForwardMode.MIXED, [1, 9, 1, 1]), (ForwardMode.DECODE, [1, 1, 1, 1])]
    totals = [p + sum(n[i] for _, n in steps) for i, p in enumerate(prefix)]
    r2t = ReqToTokenPool(len(prefix) + 1, max(totals) + 1, DEV)
    pool = MLATokenKVPool(sum(totals) + 8, 1, 2, r, dr, torch.bfloat16, "auto", DEV)
    free = (torch.randperm(sum(totals) + 7, generator=gen) + 1).tolist()
    rows, latents = [], []
    for t in totals:
        row = r2t.alloc()
        r2t.req_to_token[row, :t] = torch.tensor([free.pop() for _ in range(t)], dtype=torch.int32, device=DEV)
        rows.append(row)
        latents.append(torch.randn(t, r + dr, generator=gen).to(DEV, torch.bfloat16))
    for row, p, lat in zip(rows, prefix, latents, strict=True):
        if p:
            pool.set_latent(spec.layer_id, r2t.req_to_token[row, :p].long(), lat[:p, :r], lat[:p, r:])
    backend = FlashInferMLABackend(BackendContext(torch.device(DEV), torch.bfloat16, heads, 1, r + dr, 1, r2t, pool))
    w_kv_b = (torch.randn(heads * (dn + dv), r, generator=gen) * r ** -0.5).to(DEV, torch.bfloat16)
    proj = MLAProjections.from_kv_b_proj(w_kv_b, spec)
    lo = list(prefix)
    for mode, new in steps:
        hi = [a + n for a, n in zip(lo, new, strict=True)]
        q_nope = torch.randn(sum(new), heads, dn, generator=gen).to(DEV, torch.bfloat16)
        q_pe = torch.randn(sum(new), heads, dr, generator=gen).to(DEV, torch.bfloat16)
        fresh = torch.cat([lat[a:b] for lat, a, b in zip(latents, lo, hi, strict=True)])
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=DEV),
            positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi, strict=True)]).to(DEV),
            req_pool_indices=torch.tensor(rows, device=DEV), seq_lens=torch.tensor(hi, device=DEV),
            out_cache_loc=torch.cat([r2t.req_to_token[row, a:b].long()
                                     for row, a, b in zip(rows, lo, hi, strict=True)]),
            req_to_token_pool=r2t, token_kv_pool=pool, attn_backend=backend, seq_lens_cpu=list(hi),
            extend_seq_lens_cpu=list(new) if mode.is_extend else [],
            extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])
        backend.init_forward_metadata(batch)
        for _ in range(2):  # a second layer reuses the step's plan
            out = backend.forward_mla(q_nope, q_pe, fresh[:, :r], fresh[:, r:], spec, proj, batch)
        offset = 0
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            ref = reference_mla(q_nope[offset:offset + b - a], q_pe[offset:offset + b - a], latents[i][:b],
                                proj.w_uk, proj.w_uv, torch.arange(a, b), spec.scaling)
            err = (out[offset:offset + b - a].double() - ref).abs().max().item()
            assert err < 3e-2 * max(1.0, ref.abs().max().item()), (mode, i, err)
            offset += b - a
        lo = hi


@pytest.fixture(scope="module")
def deepseek_576(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Tiny DeepSeek-V2-Lite- and V3-shaped models with the real latent (512 + 64): what FlashInfer MLA needs."""
    from llm_test_utils import load_hf_model, make_tiny_model
    from sglx.llm.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("mla_576")
    out = {}
    for arch in ("deepseek_v2", "deepseek_v3"):
        path = make_tiny_model(root, arch, kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64,
                               num_attention_heads=16, num_key_value_heads=16)
        tok = Tokenizer.from_dir(path)
        prompts = [tok.encode(t) for t in ("The quick brown fox", "Attention reads keys and values through a "
                                           "table that maps positions to slots, one page at a time.")]
        out[arch] = (path, prompts, load_hf_model(path))
    return out


def _assert_greedy_under_hf(hf, prompt: list[int], tokens: list[int]) -> None:
    """bf16 tokens vs transformers in float32, teacher-forced on our sequence: every token is HF's argmax or
    within bf16 rounding of it (near-ties may flip in bf16 and then the sequences part ways, so exact
    sequence equality is not a fair test of a bf16 engine), and most are HF's argmax exactly."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    mine = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = logits.max(-1).values - mine
    assert tokens[0] == int(logits[0].argmax())
    assert gap.max().item() <= 0.1 * logits.std().item(), gap.tolist()
    assert (gap == 0).float().mean().item() >= 0.75, gap.tolist()


@pytest.mark.parametrize("pair", [("flashinfer", "flashinfer"), ("triton", "triton"), ("flashinfer", "triton"),
                                  ("fa4", "triton")],
                         ids=["flashinfer", "triton", "flashinfer-prefill-triton-decode", "fa4-prefill-triton-decode"])
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bf16_engine_576_latent_vs_hf_and_graphs(deepseek_576: dict, arch: str, pair: tuple[str, str]) -> None:
    """bf16 engine (page size 1) on a 512 + 64 latent: greedy tokens are transformers' (teacher-forced, within bf16
    rounding), and CUDA-graph decode gives exactly the eager engine's tokens. The hybrid pair is what the H200's
    engine medians pick for MLA (docs/benchmarks.md, session 28); its two backends share only the latent pool."""
    from sglx.llm.engine import Engine

    if "flashinfer" in pair:
        _flashinfer_or_skip()
    if "fa4" in pair:
        _fa4_prefill_or_skip()
    path, prompts, hf = deepseek_576[arch]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(model_path=str(path), dtype="bfloat16", device="cuda", prefill_attention_backend=pair[0],
                    decode_attention_backend=pair[1], page_size=1, max_total_tokens=4096,
                    disable_cuda_graph=disable) as eng:
            assert eng.info["cuda_graph"] == (not disable), eng.info.get("cuda_graph_why")
            outs.append([r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)])
    assert outs[0] == outs[1]
    for prompt, tokens in zip(prompts, outs[0], strict=True):
        _assert_greedy_under_hf(hf, prompt, tokens)


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("tokens", [33, 513, 1024, 8192, 40000])
def test_moe_align_matches_a_stable_torch_sort(tokens: int, one_program: bool) -> None:
    """moe_align's two launch shapes (one program; count, scan, place over many programs) lay pairs out as a stable
    torch argsort does, at DeepSeek-V2-Lite's routing (64 routed + 2 shared experts, 8 pairs a token)."""
    from moe_align_reference import align_by_torch_sort, assert_same_alignment
    from sglx.llm.kernels import fused_moe as fm
    from sglx.llm.kernels.moe_align import moe_align

    if one_program and tokens > 8192:
        pytest.skip("one program over 320k pairs takes seconds")
    gen = torch.Generator(DEV).manual_seed(tokens)
    routed = torch.rand(tokens, 64, generator=gen, device=DEV).topk(6, dim=1).indices
    ids = torch.cat([routed, torch.tensor([64, 65], device=DEV).expand(tokens, 2)], 1).to(torch.int32)
    block_m = fm.moe_block_m(ids.numel())
    got = moe_align(ids, 66, block_m, one_program=one_program)
    assert_same_alignment(got, align_by_torch_sort(ids, 66, block_m), block_m)


@pytest.mark.parametrize("tokens", [1, 7, 64, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_matches_the_loop(tokens: int, dtype: torch.dtype) -> None:
    """The fused Triton experts at DeepSeek-V2-Lite's expert shape (64 experts, top 6, hidden 2048, 1408)."""
    from sglx.llm.layers.moe import RoutedExperts

    gen = torch.Generator(DEV).manual_seed(tokens)
    experts = RoutedExperts(64, 2048, 1408).to(DEV, dtype)
    experts.w13.data = torch.randn(64, 2816, 2048, generator=gen, device=DEV).mul_(2048 ** -0.5).to(dtype)
    experts.w2.data = torch.randn(64, 2048, 1408, generator=gen, device=DEV).mul_(1408 ** -0.5).to(dtype)
    x = torch.randn(tokens, 2048, generator=gen, device=DEV).to(dtype)
    weights, ids = torch.topk(torch.rand(tokens, 64, generator=gen, device=DEV), 6, dim=-1)
    got = experts.forward_fused(x, weights, ids).double()
    want = torch.zeros(tokens, 2048, dtype=torch.float64, device=DEV)
    for e in ids.unique().tolist():  # float64, expert by expert
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t].double() @ experts.w13[e].double().t()
        act = torch.nn.functional.silu(h[:, :1408]) * h[:, 1408:]
        want.index_add_(0, t, weights[t, j, None].double() * (act @ experts.w2[e].double().t()))
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()
    loop = experts.forward_loop(x, weights, ids).double()
    assert (got - want).abs().max().item() <= 2 * (loop - want).abs().max().item() + 1e-3


@pytest.mark.parametrize("tokens", [1, 32])
def test_fused_moe_persistent_launch_equals_two_launches(tokens: int) -> None:
    """MoETiles(persistent=True) at V2-Lite's shape with its 2 shared experts: the one-launch path gives the two
    launches' output bitwise, twice on one work buffer (left zero, as graph replays need)."""
    from dataclasses import replace

    from sglx.llm.kernels.fused_moe import default_tiles, fused_moe, work_entries

    gen = torch.Generator(DEV).manual_seed(100 + tokens)
    dt = torch.bfloat16
    w13 = torch.randn(64, 2816, 2048, generator=gen, device=DEV).mul_(2048 ** -0.5).to(dt)
    w2 = torch.randn(64, 2048, 1408, generator=gen, device=DEV).mul_(1408 ** -0.5).to(dt)
    shared = (torch.randn(2 * 2 * 1408, 2048, generator=gen, device=DEV).mul_(2048 ** -0.5).to(dt),
              torch.randn(2048, 2 * 1408, generator=gen, device=DEV).mul_(1408 ** -0.5).to(dt))
    x = torch.randn(tokens, 2048, generator=gen, device=DEV).to(dt)
    routed = torch.rand(tokens, 64, generator=gen, device=DEV).argsort(dim=1)[:, :6]
    ids = torch.cat([routed, torch.arange(64, 66, device=DEV).expand(tokens, 2)], 1)
    weights = torch.cat([torch.rand(tokens, 6, generator=gen, device=DEV), torch.ones(tokens, 2, device=DEV)], 1)
    tiles = default_tiles(ids.numel(), False)
    want = fused_moe(x, w13, w2, weights, ids, shared=shared, tiles=replace(tiles, persistent=False))
    tiles = replace(tiles, persistent=True)
    work = torch.zeros(work_entries(4096), dtype=torch.int32, device=DEV)
    for _ in range(2):
        got = fused_moe(x, w13, w2, weights, ids, shared=shared, tiles=tiles, work=work)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert not work.any()


def test_hybrid_prefill_torch_native_decode_triton(deepseek: dict) -> None:
    from sglx.llm.engine import Engine

    path, prompts, refs = deepseek["deepseek_v3"]
    with Engine(model_path=str(path), dtype="float32", device="cuda", prefill_attention_backend="torch_native",
                decode_attention_backend="triton", max_total_tokens=4096) as eng:
        assert "hybrid" in eng.info["attention_backend"]
        results = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                                   "ignore_eos": True})
    assert [r["output_ids"] for r in results] == refs


def test_dummy_deepseek_v2_lite_one_batch(tmp_path: Path) -> None:
    """The shipped DeepSeek-V2-Lite config (15.7B params, bf16 ~31 GB) runs a decode step near its floor."""
    from sglx.bench.one_batch import OneBatchConfig, run_one_batch
    from sglx.llm.engine_config import EngineConfig

    report = run_one_batch(EngineConfig(model_path="deepseek-v2-lite", load_format="dummy", device="cuda",
                                        max_total_tokens=65536),
                           OneBatchConfig(batch_sizes=(1, 32), input_len=512, output_len=8))
    for result in report["results"]:  # H100, session 4: 2.91x at batch 1, 1.32x at batch 32 (target 1.5x)
        assert result["ratio_to_floor"] < (3.5 if result["batch_size"] == 1 else 1.6), result  # regression guards


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "torch_native", "fa4"])
def test_doctor_check_mla_backends(backend: str) -> None:
    """doctor --check's MLA problem (latent 512 + rope 64, extend over cached prefixes then decode, bf16) per backend.

    FlashInfer needs its wheels (see /work/shared/DEVICE.md); without them the test skips."""
    from sglx import platform
    from sglx.attention.checks import run_check
    from sglx.attention.registry import availability, find, prefill_only

    spec = find(backend, "llm", "mla")
    snap = platform.current()
    if not availability(spec, snap).ok and not prefill_only(spec, snap):  # fa4 on Hopper: its extend alone
        pytest.skip(f"{backend} MLA cannot run here: {availability(spec, snap).reasons}")
    result = run_check(spec, snap)
    assert result.status == "pass", result
