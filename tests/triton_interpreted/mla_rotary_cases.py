"""sglx.llm.kernels.mla_rotary vs the torch rotation DeepSeek's attention runs on CPU: bit-identical, interpreted.

Runs only under TRITON_INTERPRET=1 (tests/test_deepseek_kernels.py launches it in a child pytest).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - guarded by the launcher
    pytest.skip("run through tests/test_deepseek_kernels.py (needs TRITON_INTERPRET=1)", allow_module_level=True)

from sglx.llm.kernels.mla_rotary import apply_mla_rotary_  # noqa: E402
from sglx.llm.layers.rotary import RotaryEmbedding  # noqa: E402
from sglx.llm.models.deepseek import rotate_interleaved, rotate_neox  # noqa: E402


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(3, 5, 64), (1, 16, 8)])
def test_mla_rotary_equals_the_torch_path(interleaved, dtype, tokens, heads, dim):
    gen = torch.Generator().manual_seed(dim + heads)
    nope, latent = 16, 32
    q = torch.randn(tokens, heads * (nope + dim), generator=gen).to(dtype)  # the model's q_proj output
    kv = torch.randn(tokens, latent + dim, generator=gen).to(dtype)  # kv_a_proj output: [c_kv, k_pe]
    rope = RotaryEmbedding(dim, 10000.0, None, 4096)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 4000][:tokens]), dtype)
    q_pe = q.view(tokens, heads, nope + dim)[..., nope:]
    k_pe = kv[:, latent:]
    rotate = rotate_interleaved if interleaved else rotate_neox
    want_q, want_k = rotate(q_pe, cos, sin), rotate(k_pe[:, None, :], cos, sin)[:, 0]
    q_before, kv_before = q.clone(), kv.clone()
    apply_mla_rotary_(q_pe, k_pe, cos, sin, interleaved)
    assert torch.equal(q_pe, want_q) and torch.equal(k_pe, want_k)
    untouched = torch.ones(tokens, heads, nope + dim, dtype=torch.bool)
    untouched[..., nope:] = False
    assert torch.equal(q.view(tokens, heads, -1)[untouched], q_before.view(tokens, heads, -1)[untouched])
    assert torch.equal(kv[:, :latent], kv_before[:, :latent])
