"""sglx.llm.kernels (fused RMSNorm, residual-add + RMSNorm, rotary, SiLU-and-mul) vs the layers' torch code.

Runs only under TRITON_INTERPRET=1 (tests/test_fused_layers.py launches it in a child pytest). The
reference is the torch path the layers take on CPU, plus float64 for the norm and the activation.
Where the kernels round exactly as torch does (rotary, the residual add) results must be
bit-identical in every dtype; the norm (another order of the float32 sum) and SiLU (another exp)
may differ by one rounding step of the dtype. The same checks run at real sizes on the GPU
(tests/gpu/test_fused_layers_gpu.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_fused_layers.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.activation import silu_and_mul  # noqa: E402
from sglx.llm.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from sglx.llm.kernels.rotary import apply_rotary_  # noqa: E402
from sglx.llm.layers.norm import RMSNorm  # noqa: E402
from sglx.llm.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed), dtype=torch.float64) * scale).to(dtype)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (relative 2**-mantissa_bits, and a tiny absolute floor)."""
    rel = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=1e-6)


def _bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), (got.float() - want.float()).abs().max()


def _norm(hidden: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=_gen(seed)))
    return norm.to(dtype)


def _float64_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (40, 32), (3, 5, 24), (1, 1000)])
def test_rms_norm_matches_the_torch_path_and_float64(dtype, shape):
    # (40, 32): several rows per program and a partial last program; (1, 1000): a padded 1024 block
    norm = _norm(shape[-1], dtype, seed=1)
    x = _randn(*shape, dtype=dtype, seed=2, scale=3.0)
    got = rms_norm(x, norm.weight, EPS)
    assert got.shape == x.shape and got.dtype == dtype
    _within_one_step(got, norm(x))  # CPU tensors: the module itself runs the torch code
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), _float64_norm(x, norm.weight), rtol=tol, atol=tol)


def test_rms_norm_reads_strided_rows_and_leaves_the_input_alone():
    wide = _randn(6, 200, dtype=torch.float32, seed=3)
    x = wide[:, 50:146]  # row stride 200, a view
    before = wide.clone()
    norm = _norm(96, torch.float32, seed=4)
    _within_one_step(rms_norm(x, norm.weight, EPS), norm(x))
    assert torch.equal(wide, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_the_norm_and_the_updated_residual(dtype):
    norm = _norm(160, dtype, seed=5)
    delta = _randn(9, 160, dtype=dtype, seed=6)
    residual = _randn(9, 160, dtype=dtype, seed=7, scale=4.0)
    delta0, residual0 = delta.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(delta, residual, norm.weight, EPS)
    want_out, want_residual = norm.add_and_norm(delta, residual)  # the CPU path of the layer
    _bit_equal(new_residual, want_residual)
    _within_one_step(out, want_out)
    _within_one_step(out, norm(residual + delta))  # the norm sees the rounded sum, like the torch path
    assert torch.equal(delta, delta0) and torch.equal(residual, residual0)


def test_fused_add_rms_norm_rejects_mismatched_operands():
    norm = _norm(16, torch.float32, seed=8)
    with pytest.raises(ValueError, match="does not match"):
        fused_add_rms_norm(torch.zeros(2, 16), torch.zeros(3, 16), norm.weight, EPS)


ROPE = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},  # cos/sin scaled
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope,head_dim,hq,hkv", [("default", 64, 6, 2), ("llama3", 128, 4, 4),
                                                  ("yarn", 80, 3, 1), ("default", 256, 40, 8)])
def test_rotary_in_place_on_qkv_views_equals_the_torch_path(dtype, rope, head_dim, hq, hkv):
    # head dim 80: a masked 64-wide half; 40 heads of 256: the head loop takes two trips
    rot = RotaryEmbedding(head_dim, 500000.0, ROPE[rope], max_positions=131072)
    positions = torch.tensor([0, 1, 4097, 100000, 7])
    cos, sin = rot.cos_sin(positions, dtype)
    tokens = positions.numel()
    q_size, kv_size = hq * head_dim, hkv * head_dim
    qkv = _randn(tokens, q_size + 2 * kv_size, dtype=dtype, seed=9, scale=2.0)
    v_before = qkv[:, q_size + kv_size:].clone()
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(tokens, hq, head_dim), k.reshape(tokens, hkv, head_dim)
    want_q, want_k = RotaryEmbedding.apply(q, k, cos, sin)  # CPU: the torch code, new tensors
    apply_rotary_(q, k, cos, sin)
    _bit_equal(q, want_q)
    _bit_equal(k, want_k)
    assert torch.equal(qkv[:, :q_size].reshape(tokens, hq, head_dim), q)  # in place, inside qkv
    assert torch.equal(qkv[:, q_size + kv_size:], v_before)  # v untouched


@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float32, "auto"), (torch.float16, "auto"),
                                                   (torch.bfloat16, "auto"), (torch.float16, "fp8_e4m3"),
                                                   (torch.bfloat16, "fp8_e5m2")])
def test_rotary_and_store_equals_rotary_then_store_kv(dtype, kv_cache_dtype):
    """The fused launch leaves q/k and the KV pool exactly as apply_rotary_ followed by store_kv do."""
    from sglx.attention.kernels.store_kv import store_kv
    from sglx.llm.kernels.rotary import apply_rotary_and_store_
    from sglx.llm.kv_cache import TokenKVPool

    hq, hkv, dim, tokens = 6, 2, 80, 5
    rot = RotaryEmbedding(dim, 10000.0, None)
    cos, sin = rot.cos_sin(torch.tensor([0, 3, 9, 100, 2]), dtype)
    qkv = _randn(tokens, (hq + 2 * hkv) * dim, dtype=dtype, seed=11, scale=2.0)
    loc = torch.tensor([7, 2, 12, 5, 9])
    results = []
    for fused in (True, False):
        pool = TokenKVPool(16, 1, 1, hkv, dim, dtype, kv_cache_dtype=kv_cache_dtype, device="cpu")
        pool.k_scale[0], pool.v_scale[0] = (0.5, 2.0) if pool.is_fp8 else (1.0, 1.0)
        q, k, v = qkv.clone().split([hq * dim, hkv * dim, hkv * dim], dim=-1)
        q, k, v = q.reshape(tokens, hq, dim), k.reshape(tokens, hkv, dim), v.reshape(tokens, hkv, dim)
        args = (pool.k_buffer[0], pool.v_buffer[0], loc, pool.k_scale[0], pool.v_scale[0], pool.fp8_dtype)
        if fused:
            apply_rotary_and_store_(q, k, v, cos, sin, *args)
        else:
            apply_rotary_(q, k, cos, sin)
            store_kv(k, v, *args)
        results.append((q, k, pool.k_buffer[0].clone(), pool.v_buffer[0].clone()))
    for got, want in zip(*results):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert results[0][2][loc].ne(0).any()  # the slots were really written


def test_rotary_rejects_what_it_cannot_rotate():
    q, k = torch.zeros(2, 1, 6), torch.zeros(2, 1, 6)
    with pytest.raises(ValueError, match="shapes"):
        apply_rotary_(q, k, torch.zeros(3, 6), torch.zeros(3, 6))
    odd = torch.zeros(2, 1, 5)
    with pytest.raises(ValueError, match="even"):
        apply_rotary_(odd, odd.clone(), torch.zeros(2, 5), torch.zeros(2, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 1100), (2, 2, 2 * 48)])
def test_silu_and_mul_matches_the_torch_path_and_float64(dtype, shape):
    # 1100 columns: two column blocks, the second partial
    gate_up = _randn(*shape, dtype=dtype, seed=10, scale=4.0)
    got = silu_and_mul(gate_up)
    gate, up = gate_up.split(shape[-1] // 2, dim=-1)
    assert got.shape == gate.shape and got.dtype == dtype
    _within_one_step(got, F.silu(gate) * up)
    g, u = gate.double(), up.double()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.double(), g * torch.sigmoid(g) * u, rtol=tol, atol=tol)


# ---------------------------------------------------------------- norms as row scales after the products

def _rstd64(h: torch.Tensor) -> torch.Tensor:
    hd = h.double()
    return torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [48, 5000])
def test_row_scaled_silu_and_mul_is_silu_of_the_normed_rows_products(dtype, n_cols):
    """gate_up of the unnormed row h, scaled by 1 / rms(h) in the kernel: the SiLU-and-mul of (gate, up) / rms(h),
    against float64 (5,000 columns: two 4,096-wide programs a row, the second partial)."""
    rows, hidden = 3, 96
    h = _randn(rows, hidden, dtype=dtype, seed=20, scale=3.0)
    gate_up = _randn(rows, 2 * n_cols, dtype=dtype, seed=21, scale=8.0)
    got = silu_and_mul(gate_up, rms_of=h, eps=EPS)
    g, u = (part.double() * _rstd64(h) for part in gate_up.split(n_cols, dim=-1))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert got.shape == (rows, n_cols) and got.dtype == dtype
    torch.testing.assert_close(got.double(), g * torch.sigmoid(g) * u, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="rms_of"):
        silu_and_mul(gate_up, rms_of=h[:2], eps=EPS)


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.double()[:, None, :] + rotated * sin.double()[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store,bias", [(True, False), (False, False), (True, True), (False, True)])
def test_row_scaled_rotary_rotates_the_normed_rows_products(dtype, store, bias):
    """q, k, v of the unnormed rows h: the kernel scales each token's q, k and v (in place) by 1 / rms(h), adds the
    qkv bias (Qwen2) and rotates q and k; against float64. With the store, the pool holds exactly the k and v left in
    place."""
    from sglx.llm.kernels.rotary import RowScale, apply_rotary_and_store_

    hq, hkv, dim, tokens, hidden = 4, 2, 64, 5, 160
    rot = RotaryEmbedding(dim, 10000.0, None)
    cos, sin = rot.cos_sin(torch.tensor([0, 3, 9, 100, 2]), dtype)
    h = _randn(tokens, hidden, dtype=dtype, seed=22, scale=3.0)
    qkv = _randn(tokens, (hq + 2 * hkv) * dim, dtype=dtype, seed=23, scale=8.0)
    b = _randn((hq + 2 * hkv) * dim, dtype=dtype, seed=24) if bias else None
    added = torch.zeros_like(qkv[0]).double() if b is None else b.double()
    want = [part.double().reshape(tokens, -1, dim) * _rstd64(h)[:, :, None] + extra.reshape(-1, dim)
            for part, extra in zip(qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1),
                                   added.split([hq * dim, hkv * dim, hkv * dim]))]
    want[0], want[1] = _rotate64(want[0], cos, sin), _rotate64(want[1], cos, sin)
    q, k, v = qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    q, k, v = q.view(tokens, hq, dim), k.view(tokens, hkv, dim), v.view(tokens, hkv, dim)
    k_buf, v_buf = torch.zeros(16, hkv, dim, dtype=dtype), torch.zeros(16, hkv, dim, dtype=dtype)
    loc = torch.tensor([7, 2, 12, 5, 9])
    if store:
        apply_rotary_and_store_(q, k, v, cos, sin, k_buf, v_buf, loc, rms_of=h, eps=EPS, bias=b)
        _bit_equal(k_buf[loc], k)
        _bit_equal(v_buf[loc], v)
    else:
        apply_rotary_(q, k, cos, sin, RowScale(h, v, EPS, b))
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for got, ref in zip((q, k, v), want):
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# ---------------------------------------------------------------- the whole model, fused path forced on CPU

def _greedy_logits(model_dir, dtype: torch.dtype, feed: list[list[int]] | None, fold: bool = False
                   ) -> tuple[list[torch.Tensor], list]:
    """Logits of a 2-request extend and 4 decode steps through the paged harness; decode inputs are `feed`
    (teacher forcing, so both paths see the same tokens) or the greedy tokens of this run. fold: the norm scales
    folded into qkv / gate_up after loading (load folds only CUDA models)."""
    from llm_test_utils import PagedKVHarness
    from sglx.llm.models import load_model

    model, _ = load_model(model_dir, dtype, "cpu")
    if fold:
        for layer in model.model.layers:
            layer.fold_norms()
    harness = PagedKVHarness(model, page_size=4)
    rows = [harness.new_request(), harness.new_request()]
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (7, 12)]
    logits = [harness.extend(list(zip(rows, prompts)))]
    fed = []
    for step in range(4):
        tokens = feed[step] if feed is not None else logits[-1].argmax(-1).tolist()
        fed.append(tokens)
        logits.append(harness.decode(list(zip(rows, tokens))))
    return [x.float() for x in logits], fed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_with_the_fused_path_forced_on_cpu_equals_the_torch_path(tmp_path, monkeypatch, arch, dtype):
    """The layers' fused branches (residual folding, in-place rotary on qkv views, per-head q/k norms) give
    the torch path's logits; on a GPU the same is checked token for token through the engine."""
    from llm_test_utils import make_tiny_model
    from sglx.llm.layers import mlp, norm, rotary

    model_dir = make_tiny_model(tmp_path, arch)
    plain, fed = _greedy_logits(model_dir, dtype, None)
    for module in (norm, mlp, rotary):
        monkeypatch.setattr(module, "use_fused", lambda t: True)
    fused, _ = _greedy_logits(model_dir, dtype, fed)
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert [x.argmax(-1).tolist() for x in fused[:-1]] == fed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_with_folded_norms_as_row_scales_follows_the_torch_path(tmp_path, monkeypatch, dtype, arch):
    """Norm scales folded into the weights and the route of batched CUDA decode steps forced on CPU: every decode
    step's layers read the raw stream, the rotary and SiLU kernels scale rows by 1 / rms and o_proj / down add into
    the stream in place (`LlamaDecoderLayer.row_scaled`); logits as the unfolded torch path's, up to roundings.
    Qwen2: the qkv bias is left out of the product and added by the rotary kernel after the row scale."""
    from llm_test_utils import make_tiny_model
    from sglx.llm.layers import norm_folding
    from sglx.llm.models import llama

    model_dir = make_tiny_model(tmp_path, arch)
    plain, fed = _greedy_logits(model_dir, dtype, None)
    taken = []
    real = llama.LlamaSelfAttention.add_row_scaled

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        taken.append(args[0].shape[0])
        return real(self, *args)

    monkeypatch.setattr(llama.LlamaSelfAttention, "add_row_scaled", counted)
    monkeypatch.setattr(norm_folding, "use_fused", lambda t: True)
    folded, _ = _greedy_logits(model_dir, dtype, fed, fold=True)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert taken == [2] * (4 * layers)  # the 4 decode steps of 2 rows, never the extend
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.08}[dtype]
    for a, b in zip(folded, plain):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert [x.argmax(-1).tolist() for x in folded[:-1]] == fed


@pytest.mark.parametrize("rows,n,k,bias,block_m", [(1, 40, 96, False, None), (3, 33, 64, True, None),
                                                   (16, 64, 80, False, None), (7, 17, 32, True, None),
                                                   (20, 24, 48, False, 32)])
@pytest.mark.parametrize("dtype", [torch.float16])  # the interpreter's tl.dot mishandles bf16; the GPU tier runs bf16
def test_skinny_gemm_matches_float64(rows, n, k, bias, block_m, dtype):
    from sglx.llm.kernels.skinny_gemm import SkinnyConfig, skinny_linear

    x = _randn(rows, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2, scale=0.2)
    b = _randn(n, dtype=dtype, seed=3) if bias else None
    got = skinny_linear(x, w, b, config=SkinnyConfig(block_m=block_m), interpret=True)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    # float32 accumulation, one rounding to the dtype at the end
    step = torch.finfo(dtype).eps * want.abs().clamp_min(1.0)
    assert ((got.double() - want).abs() <= step).all()


def test_skinny_gemm_refuses_a_wide_batch_and_a_wrong_width():
    from sglx.llm.kernels.skinny_gemm import MAX_ROWS, skinny_linear

    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8), interpret=True)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(torch.zeros(2, 8), torch.zeros(4, 16), interpret=True)



@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 2048), (2, 17), (2, 2 * 2048 + 1)])
def test_greedy_argmax_equals_torch_argmax_with_ties_to_the_lowest_index(rows, vocab):
    from sglx.llm.kernels.argmax import greedy_argmax

    logits = _randn(rows, vocab, dtype=torch.float32, seed=vocab)
    logits[0, vocab - 1] = logits[0, vocab // 2] = 50.0  # a tie across chunks: the lower index wins
    if rows > 1:
        logits[1, :] = 0.0  # all equal: index 0
    got = greedy_argmax(logits, interpret=True)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
