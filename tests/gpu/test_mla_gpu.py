"""MLA on a real GPU: the triton MLA decode kernel at DeepSeek-V3 shapes vs float64, the triton and torch_native MLA
backends and CUDA graphs on tiny DeepSeek models vs transformers, doctor --check's MLA problem for triton, flashinfer
and torch_native, and a dummy DeepSeek-V2-Lite one-batch step.

Not yet run on a GPU (written in a CPU-only session). Run on the lent machine:
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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,page,heads", [(torch.bfloat16, 1, 128), (torch.bfloat16, 64, 16),
                                              (torch.float16, 16, 128)])
def test_mla_decode_kernel_real_shapes_match_float64(dtype, page, heads, kv_cache_dtype):
    """Latent 512 + rope 64, ragged contexts up to 3000 keys on scattered pages, several splits."""
    from sglx.attention.kernels.common import num_sms
    from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr
    from sglx.attention.kernels.mla_decode import (
        MLADecodeConfig,
        choose_num_kv_splits,
        head_blocks,
        mla_decode_attention,
    )
    from sglx.llm.kv_cache import ReqToTokenPool
    from sglx.llm.mla_kv_cache import MLATokenKVPool

    r, dr, lens = 512, 64, [1, 700, 3000, 129]
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
    config = MLADecodeConfig()
    splits = choose_num_kv_splits(len(lens), head_blocks(heads, config), max(lens), num_sms(torch.device(DEV)), config)
    q = torch.randn(len(lens), heads, r + dr, generator=gen).to(DEV, dtype)
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
    """float32 on CUDA: greedy tokens equal transformers' (float32 MoE runs the per-expert loop: no graphs)."""
    from sglx.llm.engine import Engine

    path, prompts, refs = deepseek[arch]
    with Engine(model_path=str(path), dtype="float32", device="cuda", attention_backend=backend,
                page_size=page_size, max_total_tokens=4096) as eng:
        assert not eng.info["cuda_graph"]
        assert "per-expert loop" in eng.info["cuda_graph_why"] or backend == "torch_native"
        results = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0.0,
                                                                   "ignore_eos": True})
    assert [r["output_ids"] for r in results] == refs


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_bf16_cuda_graphs_equal_eager(deepseek: dict, arch: str) -> None:
    """bf16 on SM90+: grouped-GEMM MoE and triton MLA decode replay CUDA graphs; tokens equal eager decode."""
    from sglx.llm.engine import Engine

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch's graph-safe grouped GEMM needs SM90+")
    path, prompts, _ = deepseek[arch]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend="triton",
                    max_total_tokens=4096, disable_cuda_graph=disable) as eng:
            assert eng.info["cuda_graph"] == (not disable)
            outs.append([r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)])
    assert outs[0] == outs[1]


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
    for result in report["results"]:
        assert result["ratio_to_floor"] < 3.0, result  # the target is 1.5x; this only guards regressions


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "torch_native"])
def test_doctor_check_mla_backends(backend: str) -> None:
    """doctor --check's MLA problem (latent 512 + rope 64, extend over cached prefixes then decode, bf16) per backend.

    FlashInfer needs its wheels (see /work/shared/DEVICE.md); without them the test skips."""
    from sglx import platform
    from sglx.attention.checks import run_check
    from sglx.attention.registry import availability, find

    spec = find(backend, "llm", "mla")
    snap = platform.current()
    if not availability(spec, snap).ok:
        pytest.skip(f"{backend} MLA cannot run here: {availability(spec, snap).reasons}")
    result = run_check(spec, snap)
    assert result.status == "pass", result
