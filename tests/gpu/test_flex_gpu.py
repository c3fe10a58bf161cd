"""The `flex_attention` backend on a real GPU, compiled (its CUDA default), vs float64 and vs HF transformers.

Not yet run on a GPU (written on a CPU-only session). Run on the lent machine:
PYTHONPATH=src:tests python3 -m pytest -m gpu tests/gpu/test_flex_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
PREFIX = [0, 700, 2000, 37]
STEPS = [("extend", [512, 64, 1, 300]), ("decode", [1, 1, 1, 1]), ("mixed", [1, 40, 1, 1]), ("decode", [1, 1, 1, 1])]

CASES = [
    # (dtype, page, hq, hkv, dim, window, cap)
    (torch.bfloat16, 1, 32, 8, 128, None, 0.0),
    (torch.float16, 16, 32, 8, 128, None, 0.0),
    (torch.bfloat16, 64, 16, 2, 64, 700, 0.0),
    (torch.bfloat16, 128, 32, 8, 128, None, 30.0),
    (torch.float16, 128, 8, 8, 64, 257, 0.0),
]


@pytest.mark.parametrize("dtype,page,hq,hkv,dim,window,cap", CASES)
def test_compiled_flex_matches_float64_step_by_step(dtype, page, hq, hkv, dim, window, cap):
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.llm.flex import FlexAttentionBackend
    from sglx.errors import BackendUnavailableError
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention

    modes = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE, "mixed": ForwardMode.MIXED}
    total = [p + sum(s[1][i] for s in STEPS) for i, p in enumerate(PREFIX)]
    cache = make_paged_cache(total, page, hkv, dim, dtype, device=DEV, fill=PREFIX, seed=page)
    ctx = BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, cache.r2t, cache.pool, {"compile": "on"})
    backend = FlexAttentionBackend(ctx)
    assert backend.compiled  # the opt-in compiled path (failed to lower on torch 2.11 + H100, 2026-11-23)
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5, sliding_window=window, logit_cap=cap)
    gen = torch.Generator(device=DEV).manual_seed(1)
    lo = list(PREFIX)
    for name, new in STEPS:
        mode = modes[name]
        hi = [a + n for a, n in zip(lo, new)]
        loc = torch.cat([cache.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))])
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=DEV),
            positions=torch.cat([torch.arange(a, b, device=DEV) for a, b in zip(lo, hi)]),
            req_pool_indices=torch.tensor(cache.rows, device=DEV), seq_lens=torch.tensor(hi, device=DEV),
            out_cache_loc=loc, req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=hi,
            extend_seq_lens_cpu=list(new) if mode.is_extend else [],
            extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])
        q = torch.randn(sum(new), hq, dim, generator=gen, device=DEV, dtype=dtype)
        k = torch.cat([kk[a:a + n] for kk, a, n in zip(cache.raw_keys, lo, new)])
        v = torch.cat([vv[a:a + n] for vv, a, n in zip(cache.raw_values, lo, new)])
        backend.init_forward_metadata(batch)
        try:
            out = backend.forward(q, k, v, layer, batch)
        except BackendUnavailableError as exc:  # torch could not build the kernel (torch 2.11: NoValidChoicesError)
            if "could not compile" not in str(exc):
                raise
            pytest.xfail(str(exc))  # the opt-in path the user is told to leave; where it compiles it is checked
        row = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            ref = reference_attention(q[row:row + n], cache.keys[i][:a + n], cache.values[i][:a + n],
                                      torch.arange(a, a + n, device=DEV), layer.scaling, window, cap)
            err = (out[row:row + n].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (name, i, err)
            row += n
        lo = hi


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_engine_with_flex_matches_hf(tmp_path, page_size):
    from llm_test_utils import hf_greedy, load_hf_model, make_tiny_model
    from sglx.llm.engine import Engine
    from sglx.llm.tokenizer import Tokenizer

    path = make_tiny_model(tmp_path, "mistral")
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Radix trees share the prefix of prompts: "
                                       "the system prompt is computed once and reused many times.")]
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, 16)[0] for p in prompts]
    with Engine(model_path=str(path), device="cuda", dtype="float32", attention_backend="flex_attention",
                page_size=page_size, max_total_tokens=4096, disable_cuda_graph=True) as eng:
        results = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                                   "ignore_eos": True})
    assert [r["output_ids"] for r in results] == refs
