"""Diffusion (DiT) attention backends against a float64 reference on random shapes (CPU tier).

Every backend that runs on this machine is run for real; fa and sage_attn (CUDA kernels) are run on the
GPU tier (tests/gpu/test_diffusion_backends_gpu.py). Here their wrappers are exercised with stand-in
kernels of the same signature, and their errors on a machine that cannot run them are checked.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from sglx import platform
from sglx.attention.diffusion.flash_attn import FlashAttentionBackend
from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sage import SageAttentionBackend
from sglx.attention.registry import all_backends, availability
from sglx.errors import BackendUnavailableError, SglxError


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """float64 attention over [B, S, H, D] with GQA (independent of every backend)."""
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    p = torch.softmax(q64 @ k64.transpose(-1, -2) * scale, dim=-1)
    return (p @ v64).transpose(1, 2)


def runnable_here() -> list[str]:
    """Dense backends that run here (sparse ones need a config and a grid: they have their own tests)."""
    snap = platform.current()
    return [s.name for s in all_backends("diffusion", "dit")
            if s.implemented and not s.features.sparse and availability(s, snap).ok]


# (batch, query tokens, key tokens, query heads, kv heads, head dim, scale): lengths off every block size
# (64, 128), GQA, head dims 64/128, an explicit scale, and cross-attention shapes (queries to text tokens).
SHAPES = [
    (1, 77, 77, 4, 4, 64, None),
    (2, 200, 200, 8, 2, 64, 0.1),
    (1, 300, 300, 6, 3, 128, None),
    (2, 129, 45, 4, 4, 64, None),
    (1, 65, 512, 2, 1, 128, 0.07),
]


@pytest.mark.parametrize("name", runnable_here())
@pytest.mark.parametrize(("b", "sq", "skv", "hq", "hkv", "d", "scale"), SHAPES)
def test_backend_matches_float64(name: str, b: int, sq: int, skv: int, hq: int, hkv: int, d: int,
                                 scale: float | None) -> None:
    from sglx.attention.registry import find

    backend = find(name, "diffusion", "dit").load()({})
    gen = torch.Generator().manual_seed(sq * 31 + skv)
    q = torch.randn(b, sq, hq, d, generator=gen)
    k = torch.randn(b, skv, hkv, d, generator=gen)
    v = torch.randn(b, skv, hkv, d, generator=gen)
    out = backend.forward_dense(q, k, v, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), reference(q, k, v, scale), atol=2e-5)


@pytest.mark.parametrize("name", runnable_here())
@pytest.mark.parametrize("position", ["prefix", "suffix"])
def test_joint_text_image_sequence(name: str, position: str) -> None:
    """MM-DiT self-attention: 3x5x7 latent tokens plus 19 text tokens, through forward() with the step's metadata."""
    from sglx.attention.registry import find

    meta = DiTAttnMetadata(grid=(3, 5, 7), num_heads=4, head_dim=64, text_tokens=19, text_position=position)
    backend = find(name, "diffusion", "dit").load()({})
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, meta.seq_len, 4, 64, generator=gen) for _ in range(3))
    out = backend.forward(q, k, v, scale=None, meta=meta, layer=3)
    assert out.shape == (2, 124, 4, 64)
    assert torch.allclose(out.double(), reference(q, k, v, None), atol=2e-5)


def test_torch_sdpa_runs_here() -> None:
    assert "torch_sdpa" in runnable_here()


# ---------------------------------------------------------------- fa: wrapper logic with a stand-in kernel


def fake_flash_attn_func(q, k, v, softmax_scale=None, causal=False):  # type: ignore[no-untyped-def]
    """FlashAttention's signature and FA4's return type (out, lse), computed in float64."""
    assert not causal and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    return reference(q, k, v, softmax_scale).to(q.dtype), None


def test_fa_wrapper_layout_gqa_scale_and_tuple_return() -> None:
    backend = FlashAttentionBackend(kernel=fake_flash_attn_func, variant="FA4")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 77, 64, generator=gen).to(torch.bfloat16).transpose(1, 2)  # [B, S, H, D], strided
    k = torch.randn(2, 45, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 45, 2, 64, generator=gen).to(torch.bfloat16)
    out = backend.forward_dense(q, k, v, scale=0.2)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), reference(q, k, v, 0.2), atol=1e-2)


def test_fa_wrapper_plain_tensor_return() -> None:
    backend = FlashAttentionBackend(kernel=lambda q, k, v, **kw: fake_flash_attn_func(q, k, v, **kw)[0],
                                    variant="FA2")
    q = torch.randn(1, 33, 2, 64).half()
    assert backend.forward_dense(q, q, q).shape == q.shape


@pytest.mark.parametrize(("dtype", "d", "needle"), [
    (torch.float32, 64, "takes float16 or bfloat16"), (torch.bfloat16, 100, "head dims up to 256 in multiples of 8"),
    (torch.bfloat16, 512, "head dims up to 256"),
])
def test_fa_wrapper_rejects_what_the_kernel_cannot_run(dtype: torch.dtype, d: int, needle: str) -> None:
    backend = FlashAttentionBackend(kernel=fake_flash_attn_func, variant="FA4")
    q = torch.randn(1, 8, 2, d).to(dtype)
    with pytest.raises(SglxError, match=needle) as info:
        backend.forward_dense(q, q, q)
    assert "torch_sdpa" in str(info.value)


def test_fa_on_a_machine_without_flash_attention_names_why_and_the_alternative() -> None:
    snap = platform.fake("cuda", gpu="NVIDIA H100 80GB HBM3", capability=(9, 0), cuda="13.0")
    with pytest.raises(BackendUnavailableError) as info:
        FlashAttentionBackend(snapshot=snap)
    msg = str(info.value)
    assert "flash_attn.cute is not installed" in msg and "sglx[fa]" in msg and "torch_sdpa" in msg


def test_fa_on_cpu_names_the_platform() -> None:
    with pytest.raises(BackendUnavailableError, match="runs on CUDA or ROCm only"):
        FlashAttentionBackend(snapshot=platform.fake("cpu"))


# ---------------------------------------------------------------- sage_attn: wrapper logic with a stand-in kernel


def test_sage_wrapper_keeps_the_callers_keys_and_passes_nhd_scale() -> None:
    seen: dict = {}

    def fake_sageattn(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k):  # type: ignore[no-untyped-def]
        seen.update(layout=tensor_layout, causal=is_causal, scale=sm_scale, smooth_k=smooth_k)
        return reference(q, k, v, sm_scale).to(q.dtype)

    backend = SageAttentionBackend(kernel=fake_sageattn)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 70, 4, 64, generator=gen).bfloat16()
    k = (torch.randn(1, 70, 2, 64, generator=gen) + 3.0).bfloat16()  # a large common key offset
    v = torch.randn(1, 70, 2, 64, generator=gen).bfloat16()
    k_before = k.clone()
    out = backend.forward_dense(q, k, v, scale=0.15)
    assert torch.equal(k, k_before)  # sageattn's smooth_k would have changed the caller's keys in place
    assert seen == {"layout": "NHD", "causal": False, "scale": 0.15, "smooth_k": False}
    assert torch.allclose(out.double(), reference(q, k, v, 0.15), atol=3e-2)  # key smoothing keeps softmax


def unmasked_tail_sageattn(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k):  # type: ignore[no-untyped-def]
    """sageattention 1.0.6's non-causal kernel in float64: the last key block is not masked, so the keys
    missing up to a multiple of 64 take part with score 0 and value 0 (measured on H100)."""
    pads = -k.shape[1] % 64
    k, v = (torch.nn.functional.pad(t.double(), (0, 0, 0, 0, 0, pads)) for t in (k, v))
    return reference(q.double(), k, v, sm_scale).to(q.dtype)


@pytest.mark.parametrize("keys", [64, 65, 129, 45, 200])
def test_sage_wrapper_is_exact_on_key_counts_off_the_64_block(keys: int) -> None:
    backend = SageAttentionBackend(kernel=unmasked_tail_sageattn)
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(2, 77, 4, 64, generator=gen, dtype=torch.float64).half()
    k = torch.randn(2, keys, 2, 64, generator=gen, dtype=torch.float64).half()
    v = torch.randn(2, keys, 2, 64, generator=gen, dtype=torch.float64).half()
    out = backend.forward_dense(q, k, v, scale=0.125)
    assert torch.allclose(out.double(), reference(q, k, v, 0.125), atol=2e-3)
    naive = unmasked_tail_sageattn(q, k, v, "NHD", False, 0.125, False)
    if keys % 64:  # the upstream kernel alone is wrong here; the wrapper is not
        assert (naive.double() - reference(q, k, v, 0.125)).abs().max() > 1e-2


@pytest.mark.parametrize(("dtype", "d", "needle"), [
    (torch.float32, 64, "takes float16 or bfloat16"), (torch.float16, 80, "takes head dims 64, 96, 128"),
])
def test_sage_wrapper_rejects_what_the_kernel_cannot_run(dtype: torch.dtype, d: int, needle: str) -> None:
    backend = SageAttentionBackend(kernel=lambda *a, **kw: None)
    q = torch.randn(1, 8, 2, d).to(dtype)
    with pytest.raises(SglxError, match=needle):
        backend.forward_dense(q, q, q)


@pytest.mark.skipif(importlib.util.find_spec("sageattention") is not None, reason="sageattention is installed")
def test_sage_without_the_package_says_what_to_install() -> None:
    with pytest.raises(BackendUnavailableError, match=r"sglx\[sage\]"):
        SageAttentionBackend()
