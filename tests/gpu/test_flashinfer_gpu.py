"""flashinfer and trtllm_mha backends on a real GPU: FlashInfer's kernels vs float64, CUDA-graph replay, HF parity.

Run on the lent machine (FlashInfer from carried wheels, see benchmarks/run_flashinfer_device.sh):
PYTHONPATH=src:/tmp/site python3 -m pytest -m gpu tests/gpu/test_flashinfer_gpu.py -q
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None

DEV = "cuda"
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
# XQA's SM90 kernel over fp8 KV multiplies in fp8 (queries and probabilities rounded to e4m3, 3 mantissa bits).
# Against float64 it erred by 0.036 on a 202-key row and by 0.144 on a 4-key row (H100, first decode step of the
# fp8 page-64 case below; a bound of 0.1 failed there), and tests/test_xqa_fp8_reference.py rebuilds both rows on
# the CPU and gets both errors to 1e-9 from a model of XQA's arithmetic (tests/xqa_fp8_reference.py). No float64
# bound passes every short row and still catches a wrong page or scale, so XQA-fp8 decode rows are compared with
# that model: within one bf16 rounding of the output (rtol 2^-7) plus 2e-3 for fp32 summation order, or twice the
# model's movement under fp8 accumulation noise where that is larger, and no overall scale error (session 10:
# tests/xqa_fp8_reference.py, tests/test_xqa_fp8_reference.py on a row the H100 computed).
SM_COUNT = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10, 12)


def _batch(cache, mode, lo, hi, new):  # noqa: ANN001, ANN202
    from sglx.llm.forward_batch import ForwardBatch

    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=DEV),
        positions=torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(DEV),
        req_pool_indices=torch.tensor(cache.rows, device=DEV), seq_lens=torch.tensor(hi, device=DEV),
        out_cache_loc=torch.cat([cache.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))]),
        req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=list(hi),
        extend_seq_lens_cpu=list(new) if mode.is_extend else [],
        extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])


def _check_xqa_fp8_row(out, q, k8, v8, bmm1_scale, v_scale, subs, where):  # noqa: ANN001, ANN202
    """One trtllm_mha decode row over fp8 KV (out, q: [Hq, D]; k8/v8: the e4m3 values the pages should hold)
    against the model of XQA's fp8 arithmetic: float64 cannot judge it (see the comment above TOL). The bound grows with
    the row's sensitivity to fp8 accumulation error, and the slope check catches a wrong scale (xqa_fp8_check)."""
    from xqa_fp8_reference import xqa_fp8_check

    got = xqa_fp8_check(out, q, k8, v8, bmm1_scale, v_scale, subs)  # MODEL_ATOL, MODEL_RTOL
    if not got["ok"] and os.environ.get("SGLX_XQA_DUMP"):  # the row, for a term-by-term look on the CPU
        folder = Path(os.environ["SGLX_XQA_DUMP"])
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"out": out.cpu(), "q": q.cpu(), "k8": k8.to(torch.float8_e4m3fn).cpu(),
                    "v8": v8.to(torch.float8_e4m3fn).cpu(), "bmm1_scale": bmm1_scale, "v_scale": v_scale,
                    "subs": subs, "where": where, **got},
                   folder / f"xqa_row_{'_'.join(str(w) for w in where)}_{len(list(folder.iterdir()))}.pt")
    assert got["ok"], (*where, "XQA fp8 model", "subs", subs, got)


CASES = [
    # (backend, dtype, page, hq, hkv, dim, kv_cache_dtype, window, cap): one head dim and dtype, so the run
    # JIT-compiles few FlashInfer modules (each costs 20-90 s on the lent GPU)
    ("flashinfer", torch.bfloat16, 1, 32, 8, 128, "auto", None, 0.0),
    ("flashinfer", torch.bfloat16, 16, 32, 8, 128, "auto", None, 0.0),
    ("flashinfer", torch.bfloat16, 64, 32, 8, 128, "auto", 300, 30.0),
    ("flashinfer", torch.bfloat16, 16, 32, 8, 128, "fp8_e4m3", None, 0.0),
    ("trtllm_mha", torch.bfloat16, 16, 32, 8, 128, "auto", None, 0.0),
    ("trtllm_mha", torch.bfloat16, 64, 32, 8, 128, "fp8_e4m3", None, 0.0),
]


@pytest.mark.parametrize("name,dtype,page,hq,hkv,dim,kv_cache_dtype,window,cap", CASES,
                         ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, float) else f"{v:g}")
def test_backend_matches_float64_step_by_step(name, dtype, page, hq, hkv, dim, kv_cache_dtype, window, cap):
    """Fresh prefill (ragged), decode, prefill on cached prefixes (paged), mixed, decode on scattered pages."""
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.registry import find
    from sglx.llm.forward_batch import ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention
    from xqa_fp8_reference import xqa_sub_seqs

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    rng = random.Random(page * 7 + dim)
    bs = 6
    steps = [(ForwardMode.EXTEND, [rng.randint(1, 700) for _ in range(bs)]), (ForwardMode.DECODE, [1] * bs),
             (ForwardMode.EXTEND, [rng.choice([1, 37, 300, 555]) for _ in range(bs)]), (ForwardMode.DECODE, [1] * bs),
             (ForwardMode.MIXED, [1, 1, 129, 1, 64, 1]), (ForwardMode.DECODE, [1] * bs)]
    total = [sum(n[i] for _, n in steps) for i in range(bs)]
    scales = (1.6, 0.7) if kv_cache_dtype != "auto" else (1.0, 1.0)
    cache = make_paged_cache(total, page, hkv, dim, dtype, device=DEV, kv_cache_dtype=kv_cache_dtype, scales=scales,
                             fill=[0] * bs, seed=page + dim)
    backend = find(name, "llm", "mha").load()(BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, cache.r2t,
                                                             cache.pool))
    if cache.pool.is_fp8:  # static per-layer scales (what FlashInfer reads); expected values = fp8 round trip
        if hasattr(cache.pool, "set_static_scales"):
            cache.pool.set_static_scales([scales[0]], [scales[1]])
        cache.pool.k_scale[0], cache.pool.v_scale[0] = scales
        fp8 = cache.pool.fp8_dtype
        cache.keys = [((k.float() / scales[0]).to(fp8).float() * scales[0]).to(dtype) for k in cache.raw_keys]
        cache.values = [((v.float() / scales[1]).to(fp8).float() * scales[1]).to(dtype) for v in cache.raw_values]
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5, sliding_window=window, logit_cap=cap)
    lo = [0] * bs
    gen = torch.Generator(device=DEV).manual_seed(1)
    for step, (mode, new) in enumerate(steps):
        hi = [a + n for a, n in zip(lo, new)]
        batch = _batch(cache, mode, lo, hi, new)
        q = torch.randn(sum(new), hq, dim, device=DEV, dtype=dtype, generator=gen)
        k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_keys, lo, hi)])
        v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_values, lo, hi)])
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, layer, batch)
        torch.cuda.synchronize()
        ragged = step == 0  # no cached prefix anywhere: attention reads this step's raw K/V
        xqa_fp8 = name == "trtllm_mha" and kv_cache_dtype != "auto" and mode is ForwardMode.DECODE
        subs = xqa_sub_seqs(SM_COUNT, bs, hkv, backend.decode_meta.max_seq_len) if xqa_fp8 else 0
        row = 0
        for i, (a, b) in enumerate(zip(lo, hi)):
            if xqa_fp8:  # e4m3 values from the raw K/V and the test's scales, not read back from the pool
                k8 = (cache.raw_keys[i][:b].float() / scales[0]).to(torch.float8_e4m3fn).float()
                v8 = (cache.raw_values[i][:b].float() / scales[1]).to(torch.float8_e4m3fn).float()
                _check_xqa_fp8_row(out[row], q[row], k8, v8, dim ** -0.5 * scales[0], scales[1], subs, (step, i))
                row += 1
                continue
            keys, values = (cache.raw_keys[i], cache.raw_values[i]) if ragged else (cache.keys[i], cache.values[i])
            ref = reference_attention(q[row:row + b - a], keys[:b], values[:b], torch.arange(a, b), dim ** -0.5,
                                      window, cap)
            err = (out[row:row + b - a].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (step, mode, i, err)
            row += b - a
        lo = hi


@pytest.mark.parametrize("name,page,tensor_cores,bucket", [
    ("flashinfer", 1, "on", 8), ("flashinfer", 16, "off", 8), ("flashinfer", 64, "auto", 8),
    ("trtllm_mha", 64, "auto", 8),
    ("flashinfer", 16, "auto", 64),  # the bucket of the 8B bs64 one-batch (session 11's decode probe)
])
def test_cuda_graph_replay_equals_eager(name, page, tensor_cores, bucket):
    """One captured decode graph (bucket 8 or 64, two layer kinds) replayed for full, partial and 1-request batches."""
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.registry import find
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    dtype, hq, hkv, dim = torch.bfloat16, 32, 8, 128
    lens = [1, 900, 33, 2048, 64, 517, 1200, 7] * (bucket // 8)
    cache = make_paged_cache(lens, page, hkv, dim, dtype, device=DEV, seed=page)
    for _ in range(1):  # a second layer in the pool
        cache.pool.k_buffer.append(cache.pool.k_buffer[0] * 0.5)
        cache.pool.v_buffer.append(-cache.pool.v_buffer[0])
        cache.pool.k_scale.append(1.0)
        cache.pool.v_scale.append(1.0)
    config = {"decode_tensor_cores": tensor_cores} if name == "flashinfer" else {}
    make = find(name, "llm", "mha").load()
    ctx = BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, cache.r2t, cache.pool, config)
    graphed, eager = make(ctx), make(ctx)
    layers = [LayerSpec(0, hq, hkv, dim, dim ** -0.5), LayerSpec(1, hq, hkv, dim, 0.8 * dim ** -0.5)]  # two plans
    rpi = torch.zeros(bucket, dtype=torch.long, device=DEV)
    seq = torch.ones(bucket, dtype=torch.long, device=DEV)
    q_static = torch.zeros(bucket, hq, dim, device=DEV, dtype=dtype)
    graphed.init_cuda_graph_state(bucket, bucket)
    graphed.init_forward_metadata_capture_cuda_graph(bucket, rpi, seq)
    static_batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=rpi, positions=rpi, req_pool_indices=rpi,
                                seq_lens=seq, out_cache_loc=rpi, req_to_token_pool=cache.r2t, token_kv_pool=cache.pool,
                                seq_lens_cpu=[1] * bucket)

    def step() -> list[torch.Tensor]:
        graphed.init_forward_metadata_in_graph(bucket)
        return [graphed.forward(q_static, q_static, q_static, layer, static_batch, save_kv_cache=False)
                for layer in layers]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = step()
    gen = torch.Generator(device=DEV).manual_seed(2)
    for picked in (list(range(bucket)), [3, 1, 6, 0, 5][:bucket - 3] + list(range(8, bucket - 3)), [2]):
        bs = len(picked)
        real = [lens[i] for i in picked]
        rpi.zero_()
        seq.fill_(1)
        rpi[:bs] = torch.tensor([cache.rows[i] for i in picked], device=DEV)
        seq[:bs] = torch.tensor(real, device=DEV)
        q = torch.randn(bs, hq, dim, device=DEV, dtype=dtype, generator=gen)
        q_static.zero_()
        q_static[:bs] = q
        graphed.init_forward_metadata_replay_cuda_graph(bucket, rpi, seq, real + [1] * (bucket - bs))
        graph.replay()
        batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=rpi[:bs], positions=rpi[:bs],
                             req_pool_indices=rpi[:bs].clone(), seq_lens=seq[:bs].clone(), out_cache_loc=rpi[:bs],
                             req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=real)
        eager.init_forward_metadata(batch)
        for j, layer in enumerate(layers):
            want = eager.forward(q, q, q, layer, batch, save_kv_cache=False)
            got = outs[j][:bs]
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
            for r, i in enumerate(picked):
                scale_k = 0.5 if j else 1.0
                keys = cache.keys[i] * scale_k
                values = -cache.values[i] if j else cache.values[i]
                ref = reference_attention(q[r:r + 1], keys, values, torch.tensor([lens[i] - 1]), layer.scaling,
                                          layer.sliding_window)
                assert (got[r:r + 1].double() - ref).abs().max().item() <= TOL[dtype], (picked, j, r)


# ---------------------------------------------------------------- the engine against Hugging Face transformers


@pytest.fixture(scope="module")
def recall_examples():  # noqa: ANN201
    """Held-out prompts of the embedded model and transformers' greedy answers (float32, stopping at EOS)."""
    import transformers

    from sglx.llm.embedded import default_model_path
    from sglx.llm.embedded.task import VALUE_LEN, make_example

    path = default_model_path()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(12)
    prompts, refs = [], []
    for n in (1, 5, 17, 40, 62, 62, 33, 9):
        prompt, _ = make_example(rng, n)
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=VALUE_LEN + 2, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
        prompts.append(ids)
        refs.append(out[0, len(ids):].tolist())
    return str(path), prompts, refs, tok.eos_token_id


def _strip(ids: list[int], eos: int) -> list[int]:
    """The answer before EOS (one side may report the EOS token, the other not)."""
    return ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("name,page", [("flashinfer", 1), ("flashinfer", 16), ("trtllm_mha", 64)])
def test_engine_greedy_tokens_equal_transformers(recall_examples, name, page):
    """float16 with CUDA graphs; the prompts run twice, so the second round prefills on radix-cache hits."""
    from sglx.llm.embedded.task import VALUE_LEN
    from sglx.llm.engine import Engine

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    path, prompts, refs, eos = recall_examples
    params = {"max_new_tokens": VALUE_LEN + 2, "temperature": 0.0}
    with Engine(model_path=path, dtype="float16", device="cuda", attention_backend=name, page_size=page,
                max_total_tokens=16384, cuda_graph_max_bs=16) as eng:
        assert eng.info["cuda_graph"] is True, eng.info
        first = eng.generate(input_ids=prompts, sampling_params=params)
        second = eng.generate(input_ids=prompts, sampling_params=params)
        replays = eng.runner.graph_runner.replays
    assert replays > 0
    want = [_strip(r, eos) for r in refs]
    assert [_strip(r["output_ids"], eos) for r in first] == want
    assert [_strip(r["output_ids"], eos) for r in second] == want


def test_hybrid_triton_prefill_flashinfer_decode_replays_prefill_graphs(recall_examples):
    """The hybrid pair gets the prefill backend's prefill graphs: single-request prefills (one by one, a radix
    hit in the second round) replay them, decode replays FlashInfer's graphs, and the answers are transformers'."""
    from sglx.llm.embedded.task import VALUE_LEN
    from sglx.llm.engine import Engine

    path, prompts, refs, eos = recall_examples
    params = {"max_new_tokens": VALUE_LEN + 2, "temperature": 0.0}
    with Engine(model_path=path, dtype="float16", device="cuda", prefill_attention_backend="triton",
                decode_attention_backend="flashinfer", page_size=16, max_total_tokens=16384,
                cuda_graph_max_bs=16) as eng:
        assert eng.info["cuda_graph"] is True and eng.info["prefill_cuda_graph"] is True, eng.info
        rounds = [[eng.generate(input_ids=[p], sampling_params=[params])[0] for p in prompts] for _ in range(2)]
        prefill_replays = eng.runner.prefill_graph_runner.replays
        decode_replays = eng.runner.graph_runner.replays
        limit = eng.info["prefill_cuda_graph_max_tokens"]
    expected = 2 * sum(len(p) <= limit for p in prompts)  # longer prompts prefill eagerly
    assert expected > 0 and prefill_replays == expected and decode_replays > 0
    want = [_strip(r, eos) for r in refs]
    for got in rounds:
        assert [_strip(r["output_ids"], eos) for r in got] == want


def test_doctor_check_passes_on_this_gpu():
    from sglx import platform
    from sglx.attention.checks import run_check
    from sglx.attention.registry import find

    for name in ("flashinfer", "trtllm_mha") if SM90 else ("flashinfer",):
        result = run_check(find(name, "llm", "mha"), platform.current())
        assert result.status == "pass", result


@pytest.mark.parametrize("name", ["flashinfer", "trtllm_mha"])
def test_calibrated_rotated_fp8_pool_matches_float64_step_by_step(name):
    """--kv-cache-scales calibrate: the first prefill freezes one K/V scale per layer over rotated keys (stored by
    sglx's Triton store kernel), the paged prefill and decode rotate their queries; float64 reference over what
    the pool holds (get_kv: dequantized, rotation undone) with unrotated queries; trtllm_mha's decode rows against
    the model of XQA's fp8 arithmetic over the pool's bytes. Passed on the H100 (session 7) when its XQA decode rows
    were held to float64 within 0.1; the model comparison is NOT YET RUN on a GPU."""
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.attention.registry import find
    from sglx.llm.forward_batch import ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention
    from xqa_fp8_reference import xqa_sub_seqs

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    dtype, page, hq, hkv, dim, bs = torch.bfloat16, 16, 32, 8, 128, 4
    steps = [(ForwardMode.EXTEND, [300, 17, 650, 1]), (ForwardMode.DECODE, [1] * bs),
             (ForwardMode.EXTEND, [37, 1, 129, 300]), (ForwardMode.DECODE, [1] * bs)]
    total = [sum(n[i] for _, n in steps) for i in range(bs)]
    cache = make_paged_cache(total, page, hkv, dim, dtype, device=DEV, kv_cache_dtype="fp8_e4m3", fill=[0] * bs,
                             seed=3)
    cache.pool.calibrate_static_scales(rotate_keys=True)
    backend = find(name, "llm", "mha").load()(BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, cache.r2t,
                                                             cache.pool))
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5)
    lo = [0] * bs
    gen = torch.Generator(device=DEV).manual_seed(2)
    for step, (mode, new) in enumerate(steps):
        hi = [a + n for a, n in zip(lo, new)]
        batch = _batch(cache, mode, lo, hi, new)
        q = torch.randn(sum(new), hq, dim, device=DEV, dtype=dtype, generator=gen)
        k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_keys, lo, hi)])
        v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_values, lo, hi)])
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, layer, batch)
        torch.cuda.synchronize()
        if step == 0:
            assert not cache.pool.calibrating and cache.pool.k_scale[0] == pytest.approx(
                float((k.float() @ cache.pool.k_rotation).abs().max()) / 200, rel=1e-3)
        xqa_fp8 = name == "trtllm_mha" and mode is ForwardMode.DECODE
        subs = xqa_sub_seqs(SM_COUNT, bs, hkv, backend.decode_meta.max_seq_len) if xqa_fp8 else 0
        q_kernel = cache.pool.rotate_query(q) if xqa_fp8 else q  # XQA's query: the backend's same call
        row = 0
        for i, (a, b) in enumerate(zip(lo, hi)):
            if xqa_fp8:  # the pool's e4m3 bytes: rotated keys / k_scale, values / v_scale
                slots, pool = cache.slots(i, 0, b), cache.pool
                k8 = pool.k_buffer[0][slots].view(pool.fp8_dtype).float()
                v8 = pool.v_buffer[0][slots].view(pool.fp8_dtype).float()
                _check_xqa_fp8_row(out[row], q_kernel[row], k8, v8, dim ** -0.5 * pool.k_scale[0], pool.v_scale[0],
                                   subs, (step, i))
                row += 1
                continue
            if step == 0:  # ragged: this step's raw K/V
                keys, values = cache.raw_keys[i][:b], cache.raw_values[i][:b]
            else:
                keys, values = cache.pool.get_kv(0, cache.slots(i, 0, b), torch.float64)
            ref = reference_attention(q[row:row + b - a], keys, values, torch.arange(a, b), dim ** -0.5)
            err = (out[row:row + b - a].double() - ref).abs().max().item()
            assert err <= TOL[dtype], (step, mode, i, err)
            row += b - a
        lo = hi


@pytest.mark.parametrize("name,page", [("flashinfer", 16), ("trtllm_mha", 64)])
def test_embedded_model_recall_with_calibrated_fp8_scales(name, page):
    """fp8_e4m3 with no checkpoint scales on a per-layer-scale backend: --kv-cache-scales auto calibrates from the
    first prefill (rotated keys), CUDA graphs are captured after it, and the answers are torch_native's over the
    same kind of pool on at least 75% of the prompts. Recall floor 78% (CPU float32 torch_native: 55/64 of these
    prompts, 85-88.5% of 2 x 200 others; scale 1.0: 52-54%). H100, session 6: recall 81/100 on both backends,
    agreement 81 and 82/100: about one prompt in five sits on an fp8 rounding boundary, where the kernels'
    accumulation order and torch's differ (the first bound, 90%, was a guess and failed)."""
    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
    from sglx.llm.engine import Engine

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    rng = random.Random(2024)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(100)]
    prompts, params = [p for p, _ in examples], {"max_new_tokens": 8, "temperature": 0.0}
    with Engine(attention_backend=name, kv_cache_dtype="fp8_e4m3", dtype="bfloat16", page_size=page,
                device=DEV) as eng:
        pool = eng.runner.token_kv_pool
        assert pool.calibrating and pool.k_rotation is not None and eng.runner.graph_runner is None
        results = eng.generate(prompts, params)
        assert not pool.calibrating and eng.info["kv_cache_scales"]["source"] == "calibrated_rotated"
        assert eng.runner.graph_runner is not None and eng.runner.graph_runner.replays > 0
    with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                dtype="bfloat16", page_size=page, device=DEV) as eng:
        reference = eng.generate(prompts, params)
    mine = [normalize_output(r["text"]) for r in results]
    theirs = [normalize_output(r["text"]) for r in reference]
    right = sum(m == a for m, (_, a) in zip(mine, examples))
    agree = sum(m == t for m, t in zip(mine, theirs))
    print(f"\n{name} fp8_e4m3 calibrated per-layer scales: recall {right}/100, same as torch_native {agree}/100")
    assert right >= 78 and agree >= 75, (right, agree)


@pytest.mark.parametrize("name,page", [("flashinfer", 16), ("trtllm_mha", 64)])
def test_embedded_model_recall_with_layer_1_kept_out_of_fp8(name, page):
    """--kv-cache-dtype-skip-layers 1 over calibrated per-layer fp8 scales: layer 1's pages are bf16 (plans of their
    own, scales 1.0), the other layers e4m3; the issue's 98% recall (CPU float32 torch_native over such a pool: 64/64
    of these prompts' first 64, 200/200 and 200/200 of 2 x 200 others). NOT YET RUN on a GPU."""
    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
    from sglx.llm.engine import Engine

    if name == "trtllm_mha" and not SM90:
        pytest.skip("XQA needs SM90/SM100/SM120")
    rng = random.Random(2024)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(100)]
    with Engine(attention_backend=name, kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                kv_cache_dtype_skip_layers="1", dtype="bfloat16", page_size=page, device=DEV) as eng:
        pool = eng.runner.token_kv_pool
        assert pool.k_buffer[1].dtype == torch.bfloat16 and pool.k_buffer[0].dtype == torch.uint8
        results = eng.generate([p for p, _ in examples], {"max_new_tokens": 8, "temperature": 0.0})
        assert eng.info["kv_cache_scales"]["unquantized_layers"] == [1]
        assert eng.runner.graph_runner is not None and eng.runner.graph_runner.replays > 0
    right = sum(normalize_output(r["text"]) == a for r, (_, a) in zip(results, examples))
    print(f"\n{name} fp8_e4m3 calibrated per-layer scales, layer 1 in bf16: recall {right}/100")
    assert right >= 98, right
