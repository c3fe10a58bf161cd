"""The GEMVs with epilogues at Llama-3.1-8B sizes: each equals the unfused kernels it replaces (the plain GEMV, then
SiLU-and-mul / rotary + K/V store) bit for bit."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the GPU tier
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")


def _rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * scale).to(dtype)


def _fused_launch(rows: int, k: int):  # type: ignore[no-untyped-def]
    """The launch the fused GEMVs take for a [rows, k] weight, as a config for the plain one (same sum order)."""
    from sglx.llm.kernels.gemv import GemvConfig, launch_params

    block_n, block_k, warps, _ = launch_params(rows, k)
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=warps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_out,k", [(14336, 4096), (1408, 2048), (1000, 1000), (1001, 1000)])
def test_gated_gemv_equals_gemv_then_silu_and_mul(n_out, k, dtype):
    """The vector-load route bit for bit (the plain GEMV on the fused one's launch: short rows take other launches
    on the plain one); the TMA route (its own tiles, so its own float32 sum order) within the unfused kernels' own
    error against float64."""
    from sglx.llm.kernels.activation import silu_and_mul
    from sglx.llm.kernels.gemv import GemvConfig, gemv
    from sglx.llm.kernels.gemv_gated import gemv_gated, tma_route

    x, w = _rand(1, k, seed=1, scale=2.0, dtype=dtype), _rand(2 * n_out, k, seed=2, scale=k ** -0.5, dtype=dtype)
    b = _rand(2 * n_out, seed=3, dtype=dtype)
    unfused = silu_and_mul(gemv(x, w, b, config=_fused_launch(2 * n_out, k))[0])
    assert torch.equal(gemv_gated(x, w, b, config=GemvConfig(tma=False)), unfused)
    assert tma_route(w, GemvConfig(), interpret=False)
    gu = x.double() @ w.double().t() + b.double()
    want = torch.nn.functional.silu(gu[:, :n_out]) * gu[:, n_out:]
    err = (gemv_gated(x, w, b, config=GemvConfig(tma=True)).double() - want).abs().max().item()
    assert err <= 1.5 * (unfused.double() - want).abs().max().item() + 1e-6, err


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("hq,hkv,d,k", [(32, 8, 128, 4096), (28, 4, 128, 3584), (8, 8, 64, 512)])
def test_rotary_gemv_equals_gemv_then_rotary_and_store(hq, hkv, d, k, kv_cache_dtype):
    from sglx.attention.llm.kv_store import StepKVSlots
    from sglx.llm.kernels.gemv import gemv
    from sglx.llm.kernels.gemv_rotary import gemv_rotary_store
    from sglx.llm.kernels.rotary import apply_rotary_and_store_
    from sglx.llm.kv_cache import TokenKVPool
    from sglx.llm.layers.rotary import RotaryEmbedding

    rows = (hq + 2 * hkv) * d
    x, w, b = _rand(1, k, seed=11, scale=2.0), _rand(rows, k, seed=12, scale=k ** -0.5), _rand(rows, seed=13)
    cos, sin = RotaryEmbedding(d, 500000.0, None, 8192).cos_sin(torch.tensor([3071], device=DEV), torch.bfloat16)
    loc = torch.tensor([77], device=DEV)
    pools = [TokenKVPool(128, 1, 1, hkv, d, torch.bfloat16, kv_cache_dtype, DEV) for _ in range(2)]
    for p in pools:
        p.k_scale[0], p.v_scale[0] = (0.04, 0.02) if p.is_fp8 else (1.0, 1.0)
    slots = [StepKVSlots(p.k_buffer[0], p.v_buffer[0], loc, float(p.k_scale[0]), float(p.v_scale[0]), p.fp8_dtype)
             for p in pools]
    q = gemv_rotary_store(x, w, b, cos, sin, hq, hkv, slots[0])
    q2, k2, v2 = gemv(x, w, b, config=_fused_launch(rows, k))[0].split([hq * d, hkv * d, hkv * d], dim=-1)
    q2, k2 = q2.reshape(1, hq, d).clone(), k2.reshape(1, hkv, d).clone()
    s = slots[1]
    apply_rotary_and_store_(q2, k2, v2.reshape(1, hkv, d), cos, sin, s.k_buffer, s.v_buffer, loc, s.k_scale,
                            s.v_scale, s.fp8_dtype)
    assert torch.equal(q, q2[0])
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])


# ---------------------------------------------------------------- norm scales folded into the weights

@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (2048, 1408)])
def test_gemv_adding_to_a_row_equals_torchs_add(n, k):
    from sglx.llm.kernels.gemv import gemv

    x, w, r = _rand(1, k, seed=21), _rand(n, k, seed=22, scale=k ** -0.5), _rand(1, n, seed=23, scale=4.0)
    assert torch.equal(gemv(x, w, add_to=r)[0], r + gemv(x, w)[0])


def _folded(k: int, w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(w with a random norm scale folded in, float64 rmsnorm(x) w^T with the unfolded w, one rounding of each
    product term as the bound)."""
    from sglx.llm.layers.norm import RMSNorm
    from sglx.llm.layers.norm_folding import fold_norm_into

    norm = RMSNorm(k, 1e-5).to(DEV, torch.bfloat16)
    norm.weight.data = (1 + 0.3 * _rand(k, seed=31, dtype=torch.float32)).bfloat16()
    g = norm.weight.detach().double().clone()
    folded = w.clone()
    fold_norm_into(norm, folded)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g
    bound = 4 * torch.finfo(torch.bfloat16).eps * (normed.abs() @ w.double().abs().t()).max().item()
    return folded, normed @ w.double().t(), bound


@pytest.mark.parametrize("rms_pass", [1, 2, None])  # None: the default route (TMA on sm_90+)
def test_folded_norm_gemvs_at_llama_shapes_match_float64(rms_pass):
    from sglx.attention.llm.kv_store import StepKVSlots
    from sglx.llm.kernels.gemv import GemvConfig
    from sglx.llm.kernels.gemv_gated import gemv_gated
    from sglx.llm.kernels.gemv_rotary import gemv_rotary_store
    from sglx.llm.layers.rotary import RotaryEmbedding

    k, inter, hq, hkv, d = 4096, 14336, 32, 8, 128
    config = GemvConfig(rms_pass=rms_pass)
    x = _rand(1, k, seed=30, scale=3.0)
    w = _rand(2 * inter, k, seed=32, scale=k ** -0.5)
    folded, gu, bound = _folded(k, w, x)
    g, u = gu[:, :inter], gu[:, inter:]
    got = gemv_gated(x, folded, config=config, rms_eps=1e-5).double()
    assert (got - g * torch.sigmoid(g) * u).abs().max().item() <= bound * (g.abs().max() + u.abs().max()).item()
    w = _rand((hq + 2 * hkv) * d, k, seed=33, scale=k ** -0.5)
    folded, full, bound = _folded(k, w, x)
    cos, sin = RotaryEmbedding(d, 500000.0, None, 8192).cos_sin(torch.tensor([3071], device=DEV), torch.bfloat16)
    kb = torch.zeros(16, hkv, d, device=DEV, dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)
    q = gemv_rotary_store(x, folded, None, cos, sin, hq, hkv, StepKVSlots(kb, vb, torch.tensor([9], device=DEV),
                          1.0, 1.0, None), config=config, rms_eps=1e-5).double()
    c, s = cos.double()[0], sin.double()[0]
    qd = full[:, :hq * d].reshape(hq, d)
    want_q = qd * c + torch.cat([-qd[:, d // 2:], qd[:, :d // 2]], dim=-1) * s
    tol = 2 * bound + 2 * torch.finfo(torch.bfloat16).eps * full.abs().max().item()
    assert (q - want_q).abs().max().item() <= tol
    assert (vb[9].double() - full[:, (hq + hkv) * d:].reshape(hkv, d)).abs().max().item() <= tol


def _hf_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:  # noqa: ANN001
    """transformers' float32 log-softmax over the vocabulary at each generated position (teacher-forced)."""
    from llm_test_utils import load_hf_model

    hf = load_hf_model(model_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.double(), -1)


class _NormLaunches:
    """RMSNorm kernel launches counted per setting of a two-way comparison (`on`: the setting now running)."""

    def __init__(self, monkeypatch) -> None:  # noqa: ANN001
        from sglx.llm.kernels import rmsnorm

        self.count = {True: 0, False: 0}
        self.on = True
        real = rmsnorm._launch

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.count[self.on] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(rmsnorm, "_launch", counted)


def _wide_llama(tmp_path, arch: str = "llama"):  # noqa: ANN001, ANN202
    """A tiny Llama-family model wider than the norm-inside rule (hidden 2560), so its norms fold at load."""
    from llm_test_utils import make_tiny_model

    return make_tiny_model(tmp_path, arch, std=0.03, hidden_size=2560, intermediate_size=3072,
                           num_attention_heads=20, num_key_value_heads=4, head_dim=128)


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_batch1_with_folded_norms_follows_transformers(tmp_path, monkeypatch, graphs):
    """A Llama wider than the norm-inside rule (hidden 2560) in bf16 on the Triton backend: the norm scales are folded
    into qkv / gate_up at load, so batch-1 decode steps launch only the final norm. Against transformers' float32
    log-probabilities of the same tokens (teacher-forced), the folded model is as close as the unfolded one (bf16
    noise, the fold's roundings added) and each greedy token is transformers' argmax up to that noise."""
    from sglx.llm.engine import Engine
    from sglx.llm.layers import norm_folding

    model_dir = _wide_llama(tmp_path)
    prompt, steps = [5, 77, 201, 9, 33, 140, 61, 2, 18, 40, 41], 12
    norm_launches = _NormLaunches(monkeypatch)
    off_argmax, off_logprob = {}, {}
    for fold in (True, False):
        monkeypatch.setattr(norm_folding, "_FOLD_ON", fold)
        norm_launches.on = fold
        with Engine(model_path=str(model_dir), dtype="bfloat16", device="cuda", attention_backend="triton",
                    max_total_tokens=2048, cuda_graph_max_bs=4, disable_cuda_graph=not graphs) as eng:
            out = eng.generate(input_ids=[prompt], sampling_params=[{"max_new_tokens": steps, "temperature": 0.0,
                                                                     "ignore_eos": True}], return_logprob=True)[0]
        ref = _hf_logprobs(model_dir, prompt, out["output_ids"])
        picked = ref[torch.arange(steps), torch.tensor(out["output_ids"])]
        off_argmax[fold] = (ref.max(-1).values - picked).max().item()
        off_logprob[fold] = (torch.tensor(out["output_logprobs"], dtype=torch.float64) - picked).abs().max().item()
    print(f"largest log-probability gap to transformers {off_logprob}, to its argmax {off_argmax}")
    assert off_logprob[True] <= 1.5 * off_logprob[False] + 0.02, (off_logprob, off_argmax)
    assert max(off_argmax.values()) <= 0.05, (off_logprob, off_argmax)
    if not graphs:  # eager: every decode step's norms are Python calls; folded, only the final norm remains
        assert norm_launches.count[False] - norm_launches.count[True] >= 2 * 2 * (steps - 1)


@pytest.mark.parametrize("graphs,kv,arch", [(True, "auto", "llama"), (False, "auto", "llama"),
                                            (True, "fp8_e4m3", "llama"), (True, "auto", "qwen2")])
def test_engine_batched_decode_with_norms_as_row_scales_follows_transformers(tmp_path, monkeypatch, graphs, kv,
                                                                            arch):
    """Three requests decoding together on the folded model of the batch-1 test: each decode step of 2-3 rows reads
    the raw stream (the rotary and SiLU kernels scale rows by 1 / rms, o_proj / down add into the stream in place,
    `LlamaDecoderLayer.row_scaled`). Against transformers' float32 log-probabilities per request, the route is as
    close as the unfolded model and (bf16 KV) each greedy token is transformers' argmax up to bf16 noise; eager, its
    steps launch only the final norm. fp8 KV (per-token scales): the pool is written by the backend from the k / v the
    rotary kernel scaled in place. Qwen2: its qkv bias is added by the rotary kernel after the row scale."""
    from sglx.llm.engine import Engine
    from sglx.llm.layers import norm_folding

    model_dir = _wide_llama(tmp_path, arch)
    prompts = [[5, 77, 201, 9, 33, 140, 61, 2, 18, 40, 41], [7, 7, 300, 12], [99, 3, 150, 150, 8, 1, 64, 200, 11]]
    steps = 10
    norm_launches = _NormLaunches(monkeypatch)
    off_argmax, off_logprob = {}, {}
    for route in (True, False):
        monkeypatch.setattr(norm_folding, "_FOLD_ON", route)
        monkeypatch.setattr(norm_folding, "_ROW_SCALED_ON", route)
        norm_launches.on = route
        with Engine(model_path=str(model_dir), dtype="bfloat16", device="cuda", attention_backend="triton",
                    max_total_tokens=2048, cuda_graph_max_bs=4, disable_cuda_graph=not graphs,
                    kv_cache_dtype=kv) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": steps, "temperature": 0.0,
                                                                     "ignore_eos": True}] * 3, return_logprob=True)
        gaps_argmax, gaps_logprob = [], []
        for prompt, out in zip(prompts, outs):
            ref = _hf_logprobs(model_dir, prompt, out["output_ids"])
            picked = ref[torch.arange(steps), torch.tensor(out["output_ids"])]
            gaps_argmax.append((ref.max(-1).values - picked).max().item())
            gaps_logprob.append((torch.tensor(out["output_logprobs"], dtype=torch.float64) - picked).abs().max().item())
        off_argmax[route], off_logprob[route] = max(gaps_argmax), max(gaps_logprob)
    print(f"largest log-probability gap to transformers {off_logprob}, to its argmax {off_argmax}")
    assert off_logprob[True] <= 1.5 * off_logprob[False] + 0.02, (off_logprob, off_argmax)
    if kv == "auto":
        assert max(off_argmax.values()) <= 0.05, (off_logprob, off_argmax)
    if not graphs:  # eager: the unfolded steps launch two add + norm kernels a layer, the route none
        assert norm_launches.count[False] - norm_launches.count[True] >= 2 * 2 * (steps - 1)


# ---------------------------------------------------------------- programmatic dependent launch

def test_pdl_chain_replayed_in_a_graph_equals_the_chain_without_pdl():
    """A chain of GEMVs where each reads the one before (the residual stream through o_proj / gate_up / down shapes):
    launched with PDL (each kernel launches during the previous one's tail and its programs wait before reading) and
    replayed in a CUDA graph, it gives the numbers of the same chain launched plainly, bit for bit. A missing wait
    would read the stream before the previous kernel wrote it."""
    from sglx.llm.kernels.gemv import GemvConfig, gemv
    from sglx.llm.kernels.gemv_gated import gemv_gated

    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("PDL needs sm_90+")
    hidden, inter, layers = 4096, 14336, 6
    o = [_rand(hidden, hidden, seed=40 + i, scale=hidden ** -0.5) for i in range(layers)]
    gu = [_rand(2 * inter, hidden, seed=50 + i, scale=hidden ** -0.5) for i in range(layers)]
    down = [_rand(hidden, inter, seed=60 + i, scale=inter ** -0.5) for i in range(layers)]
    x = _rand(1, hidden, seed=70)

    def chain(config: GemvConfig) -> torch.Tensor:
        h = x
        for i in range(layers):
            h = gemv(h, o[i], add_to=h, config=config)[0]
            h = gemv(gemv_gated(h, gu[i], config=config, rms_eps=1e-5), down[i], add_to=h, config=config)[0]
        return h

    want = chain(GemvConfig(pdl=False))
    pdl = GemvConfig(pdl=True)
    chain(pdl)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(pdl)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert torch.equal(chain(pdl), want)  # eager PDL launches too
