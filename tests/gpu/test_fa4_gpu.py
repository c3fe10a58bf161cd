"""The `fa4` backend (flash_attn.cute) on an SM90/SM100 GPU: vs float64, CUDA graphs vs eager, vs HF, hybrid.

Needs flash-attn-4 (benchmarks/run_fa4_llm_device.sh installs it on the lent H100). Run there:
PYTHONPATH=src:tests:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 -m pytest -m gpu \
    tests/gpu/test_fa4_gpu.py -q
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _fa4_ready() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        return False
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _fa4_ready(), reason="needs an SM90/SM100 GPU with flash-attn-4 (flash_attn.cute)"),
]

DEV = "cuda"
PAGE = 128
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
PREFIX = [0, 700, 2000, 37]  # prefix hits of every alignment to the 128-token pages
STEPS = [("extend", [512, 64, 1, 300]), ("decode", [1, 1, 1, 1]), ("mixed", [1, 40, 1, 1]), ("decode", [1, 1, 1, 1])]

CASES = [
    # (dtype, hq, hkv, dim, window, cap)
    (torch.bfloat16, 32, 8, 128, None, 0.0),
    (torch.float16, 32, 8, 128, None, 0.0),
    (torch.bfloat16, 16, 2, 64, 700, 0.0),
    (torch.bfloat16, 32, 8, 128, None, 30.0),
    (torch.float16, 8, 8, 64, 257, 0.0),
    (torch.bfloat16, 8, 1, 256, None, 0.0),
]


@pytest.mark.parametrize("dtype,hq,hkv,dim,window,cap", CASES)
def test_fa4_matches_float64_step_by_step(dtype, hq, hkv, dim, window, cap):
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.llm.fa4 import FA4Backend
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention

    modes = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE, "mixed": ForwardMode.MIXED}
    total = [p + sum(s[1][i] for s in STEPS) for i, p in enumerate(PREFIX)]
    cache = make_paged_cache(total, PAGE, hkv, dim, dtype, device=DEV, fill=PREFIX, seed=dim)
    ctx = BackendContext(torch.device(DEV), dtype, hq, hkv, dim, PAGE, cache.r2t, cache.pool)
    backend = FA4Backend(ctx)
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
        out = backend.forward(q, k, v, layer, batch)
        torch.cuda.synchronize()
        row = 0
        for i, (a, n) in enumerate(zip(lo, new)):
            ref = reference_attention(q[row:row + n], cache.keys[i][:a + n], cache.values[i][:a + n],
                                      torch.arange(a, a + n, device=DEV), layer.scaling, window, cap)
            err = (out[row:row + n].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (name, i, err)
            row += n
        lo = hi


def test_fa4_refuses_other_page_sizes_on_sm90():
    from sglx.attention.llm.base import BackendContext
    from sglx.attention.llm.fa4 import FA4Backend
    from sglx.errors import BackendUnavailableError
    from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the 128-token page rule is SM90's")
    ctx = BackendContext(torch.device(DEV), torch.bfloat16, 8, 2, 64, 64, ReqToTokenPool(2, 256, DEV),
                         TokenKVPool(256, 64, 1, 2, 64, torch.bfloat16, device=DEV))
    with pytest.raises(BackendUnavailableError, match="use --page-size 128"):
        FA4Backend(ctx)


def test_doctor_check_passes_for_fa4():
    from sglx import platform
    from sglx.attention.checks import run_check
    from sglx.attention.registry import find

    result = run_check(find("fa4", "llm", "mha"), platform.current())
    assert result.status == "pass", result


# ---------------------------------------------------------------- engine: HF parity, graphs, hybrid

SEED = 2
LINES = (0, 2, 7, 8)  # corpus lines whose HF greedy continuations keep a top-2 logit margin >= 0.01 (fp16-safe)
STEPS_GEN = 20


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    from llm_test_utils import CORPUS, hf_greedy, load_hf_model, make_tiny_model
    from sglx.llm.tokenizer import Tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("fa4_models"), "llama", seed=SEED, head_dim=64)
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(CORPUS.splitlines()[i]) for i in LINES]
    hf = load_hf_model(path)
    return path, prompts, [hf_greedy(hf, p, STEPS_GEN)[0] for p in prompts]


def _generate(path: Path, prompts: list[list[int]], **flags) -> tuple[list[dict], dict, int]:
    from sglx.llm.engine import Engine

    flags = {"dtype": "float16", "device": DEV, "max_total_tokens": 8192, "cuda_graph_max_bs": 8, **flags}
    params = [{"max_new_tokens": STEPS_GEN - 3 * i, "temperature": 0.0, "ignore_eos": True}
              for i in range(len(prompts))]  # the decode batch shrinks 4 -> 1 through the buckets
    with Engine(model_path=str(path), **flags) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        runner = eng.runner
        replays = runner.graph_runner.replays if runner.graph_runner is not None else 0
        return out, eng.info, replays


def test_fa4_engine_greedy_equals_hf_and_graphs_equal_eager(llama):
    path, prompts, refs = llama
    graphed, info, replays = _generate(path, prompts, attention_backend="fa4")
    assert (info["attention_backend"], info["page_size"], info["cuda_graph"]) == ("fa4", 128, True)
    assert replays >= STEPS_GEN - 4
    for out, ref, i in zip(graphed, refs, range(len(refs))):
        assert out["output_ids"] == ref[:STEPS_GEN - 3 * i]
    eager, info_eager, eager_replays = _generate(path, prompts, attention_backend="fa4", disable_cuda_graph=True)
    assert info_eager["cuda_graph"] is False and eager_replays == 0
    for g, e in zip(graphed, eager):
        assert g["output_ids"] == e["output_ids"]
        torch.testing.assert_close(torch.tensor(g["output_logprobs"]), torch.tensor(e["output_logprobs"]),
                                   atol=2e-3, rtol=0)


def test_hybrid_fa4_prefill_triton_decode_equals_hf(llama):
    path, prompts, refs = llama
    out, info, replays = _generate(path, prompts, prefill_attention_backend="fa4", decode_attention_backend="triton")
    assert (info["prefill_attention_backend"], info["decode_attention_backend"]) == ("fa4", "triton")
    assert info["page_size"] == 128 and info["cuda_graph"] is True and replays > 0  # graphs follow triton decode
    for res, ref, i in zip(out, refs, range(len(refs))):
        assert res["output_ids"] == ref[:STEPS_GEN - 3 * i]
    rev, info_rev, _ = _generate(path, prompts, prefill_attention_backend="torch_native",
                                 decode_attention_backend="fa4")
    assert info_rev["page_size"] == 128 and info_rev["cuda_graph"] is True
    assert [r["output_ids"] for r in rev] == [r["output_ids"] for r in out]
