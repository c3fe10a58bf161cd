"""Fused layer kernels (sglx.llm.kernels) on a real GPU: each kernel vs the torch path at Llama-3.1-8B
sizes in bf16/fp16, greedy tokens with fused kernels equal the unfused path, and fewer kernels per step.

Run on the lent machine: PYTHONPATH=src python3 -m pytest -m gpu tests/gpu/test_fused_layers_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, INTERMEDIATE, HQ, HKV, HEAD_DIM = 4096, 14336, 32, 8, 128  # Llama-3.1-8B
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 64, 2048]


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _one_step(got: torch.Tensor, want: torch.Tensor, max_mismatch: float) -> None:
    """Different in at most `max_mismatch` of the elements, and there by a rounding step or two of the dtype
    (a flipped rounding inside the kernel can move the final rounding by one more step)."""
    rel = {torch.float16: 2**-10, torch.bfloat16: 2**-7}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * rel, atol=1e-5)
    assert (got != want).float().mean().item() <= max_mismatch


def _norm(hidden: int, dtype: torch.dtype):
    from sglx.llm.layers.norm import RMSNorm

    norm = RMSNorm(hidden, 1e-5).to("cuda")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, device="cuda"))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm_at_llama_size(dtype, tokens):
    from sglx.llm.kernels import fused_kernels
    from sglx.llm.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    norm = _norm(HIDDEN, dtype)
    delta = _randn(tokens, HIDDEN, dtype=dtype, seed=1)
    residual = _randn(tokens, HIDDEN, dtype=dtype, seed=2, scale=8.0)
    out, updated = fused_add_rms_norm(delta, residual, norm.weight, norm.eps)
    with fused_kernels(False):
        want_out, want_updated = norm.add_and_norm(delta, residual)
        want_plain = norm(residual)
    assert torch.equal(updated, want_updated)  # the residual add rounds exactly like torch's
    _one_step(out, want_out, max_mismatch=0.01)
    _one_step(rms_norm(residual, norm.weight, norm.eps), want_plain, max_mismatch=0.01)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_on_a_strided_q_view(dtype):
    from sglx.llm.kernels import fused_kernels

    norm = _norm(HEAD_DIM, dtype)
    qkv = _randn(300, (HQ + 2 * HKV) * HEAD_DIM, dtype=dtype, seed=3)
    q = qkv[:, :HQ * HEAD_DIM].reshape(300, HQ, HEAD_DIM)  # Qwen3's q_norm input
    got = norm(q)
    with fused_kernels(False):
        want = norm(q)
    _one_step(got, want, max_mismatch=0.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_in_place_is_bit_identical_to_the_torch_path(dtype, tokens):
    from sglx.llm.kernels import fused_kernels
    from sglx.llm.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(HEAD_DIM, 500000.0, LLAMA31_ROPE, max_positions=131072)
    gen = torch.Generator(device="cuda").manual_seed(4)
    positions = torch.randint(0, 131072, (tokens,), generator=gen, device="cuda")
    cos, sin = rot.cos_sin(positions, dtype)
    q_size, kv_size = HQ * HEAD_DIM, HKV * HEAD_DIM
    qkv = _randn(tokens, q_size + 2 * kv_size, dtype=dtype, seed=5, scale=3.0)
    v_before = qkv[:, q_size + kv_size:].clone()
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(tokens, HQ, HEAD_DIM), k.reshape(tokens, HKV, HEAD_DIM)
    with fused_kernels(False):
        want_q, want_k = RotaryEmbedding.apply(q, k, cos, sin)
    got_q, got_k = RotaryEmbedding.apply(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_at_llama_size(dtype, tokens):
    from sglx.llm.kernels.activation import silu_and_mul

    gate_up = _randn(tokens, 2 * INTERMEDIATE, dtype=dtype, seed=6, scale=3.0)
    gate, up = gate_up.split(INTERMEDIATE, dim=-1)
    _one_step(silu_and_mul(gate_up), F.silu(gate) * up, max_mismatch=0.01)


# ---------------------------------------------------------------- engine: fused == unfused

LENGTHS = [5, 40, 17, 63, 9]
STEPS = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from llm_test_utils import make_tiny_model

    root = tmp_path_factory.mktemp("fused_models")
    return {"llama": make_tiny_model(root, "llama", head_dim=64),
            "qwen3": make_tiny_model(root, "qwen3", head_dim=64),
            "llama4": make_tiny_model(root, "llama", head_dim=64, num_hidden_layers=4)}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(4, 300, (n,), generator=gen).tolist() for n in LENGTHS]


class _Counter:
    """Counts calls of the fused kernel entry points (the layers look them up at call time)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from sglx.llm.kernels import activation, rmsnorm, rotary

        self.calls = 0
        for module, name in ((rmsnorm, "rms_norm"), (rmsnorm, "fused_add_rms_norm"), (rotary, "apply_rotary_"),
                             (activation, "silu_and_mul")):
            monkeypatch.setattr(module, name, self._wrap(getattr(module, name)))

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return counted


def _generate(path: Path, fused: bool, **flags) -> list[dict]:
    from sglx.llm.engine import Engine
    from sglx.llm.kernels import fused_kernels

    flags = {"dtype": "float32", "device": "cuda", "attention_backend": "triton", "max_total_tokens": 4096,
             "cuda_graph_max_bs": 16, **flags}
    params = [{"max_new_tokens": STEPS - 3 * i, "temperature": 0.0, "ignore_eos": True} for i in range(len(LENGTHS))]
    with fused_kernels(fused), Engine(model_path=str(path), **flags) as eng:
        assert eng.info["cuda_graph"] is not flags.get("disable_cuda_graph", False)
        return eng.generate(input_ids=_prompts(), sampling_params=params, return_logprob=True)


@pytest.mark.parametrize("arch,graphs", [("llama", True), ("qwen3", True), ("llama", False)])
def test_engine_greedy_tokens_with_fused_kernels_equal_the_unfused_path(models, monkeypatch, arch, graphs):
    counter = _Counter(monkeypatch)
    fused = _generate(models[arch], True, disable_cuda_graph=not graphs)
    calls = counter.calls
    assert calls > 0, "the fused kernels never ran"
    plain = _generate(models[arch], False, disable_cuda_graph=not graphs)
    assert counter.calls == calls, "the unfused path called a fused kernel"
    for a, b in zip(fused, plain):
        assert a["output_ids"] == b["output_ids"]
        torch.testing.assert_close(torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]),
                                   atol=1e-4, rtol=1e-4)


def _kernels_in_one_decode_step(path: Path, fused: bool) -> int:
    """CUDA kernels (and copies) the profiler sees in one eager decode step of one request."""
    from torch.profiler import ProfilerActivity, profile

    from sglx.llm.engine_config import EngineConfig
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from sglx.llm.kernels import fused_kernels
    from sglx.llm.model_runner import ModelRunner

    with fused_kernels(fused):
        runner = ModelRunner(EngineConfig(model_path=str(path), dtype="bfloat16", device="cuda",
                                          attention_backend="triton", disable_cuda_graph=True,
                                          max_total_tokens=256, max_running_requests=2))
        try:
            n = 8
            slots = torch.arange(1, n + 2, device="cuda")
            runner.req_to_token_pool.req_to_token[1, :n + 1] = slots.to(runner.req_to_token_pool.req_to_token.dtype)
            common = dict(req_pool_indices=torch.tensor([1], device="cuda"),
                          req_to_token_pool=runner.req_to_token_pool, token_kv_pool=runner.token_kv_pool)
            prefill = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.arange(4, 4 + n, device="cuda"),
                                   positions=torch.arange(n, device="cuda"), seq_lens=torch.tensor([n], device="cuda"),
                                   out_cache_loc=slots[:n], seq_lens_cpu=[n], extend_seq_lens_cpu=[n], **common)
            token = runner.forward(prefill).argmax(-1)

            def decode() -> torch.Tensor:
                return runner.forward(ForwardBatch(
                    mode=ForwardMode.DECODE, input_ids=token, positions=torch.tensor([n], device="cuda"),
                    seq_lens=torch.tensor([n + 1], device="cuda"), out_cache_loc=slots[n:n + 1],
                    seq_lens_cpu=[n + 1], **common))

            decode()  # compile and warm up
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                decode()
                torch.cuda.synchronize()
            return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        finally:
            runner.release_memory()


def test_a_decode_step_runs_far_fewer_kernels_per_layer(models):
    counts = {(name, fused): _kernels_in_one_decode_step(models[name], fused)
              for name in ("llama", "llama4") for fused in (True, False)}
    if not any(counts.values()):
        pytest.skip("the profiler saw no CUDA activity here (CUPTI unavailable)")
    per_layer = {fused: (counts[("llama4", fused)] - counts[("llama", fused)]) / 2 for fused in (True, False)}
    outside = {fused: counts[("llama", fused)] - 2 * per_layer[fused] for fused in (True, False)}
    print(f"\nkernels per decode step (bf16, 1 request): per layer fused {per_layer[True]:.0f}, "
          f"unfused {per_layer[False]:.0f}; outside the layers fused {outside[True]:.0f}, "
          f"unfused {outside[False]:.0f}; raw {counts}")
    # fused, per layer: 2 norms, rotary, SiLU-and-mul, store K/V + 2 attention kernels, 4 GEMMs (cuBLAS may
    # split a GEMM in two); unfused adds ~26 element-wise kernels (8 per norm, 10 for rotary, 2 adds, 1 more)
    assert per_layer[True] <= 16
    assert per_layer[True] + 20 <= per_layer[False]
