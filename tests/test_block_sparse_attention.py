"""The block-sparse attention kernel: interpreted cases vs float64 (CPU), input checks, and the GPU vs float64."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.reference import masked_attention
from sglx.errors import SglxError
from triton_interpreted.launch import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _full(seq: int, block: int, b: int = 1, h: int = 1) -> BlockSparseLayout:
    nb = -(-seq // block)
    return BlockSparseLayout.from_block_mask(torch.ones(b, h, nb, nb, dtype=torch.bool), block, block, seq)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_matches_float64_under_the_interpreter():
    run_interpreted("block_sparse_cases.py")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(("shape", "dtype", "seq", "match"), [
    ((1, 32, 2, 80), torch.float16, 32, "head dims"),
    ((1, 32, 2, 64), torch.float32, 32, "float16 or bfloat16"),
    ((1, 32, 2, 64), torch.float16, 48, "layout is for 48 tokens"),
    ((1, 32, 2, 64), torch.float16, 32, "CUDA"),
])
def test_bad_input_is_one_clear_error(shape, dtype, seq, match):
    from sglx.attention.kernels.block_sparse_attention import block_sparse_attention

    q = torch.randn(shape).to(dtype)
    with pytest.raises(SglxError, match=match):
        block_sparse_attention(q, q, q, _full(seq, 16))


def test_padding_keys_are_never_attended_by_the_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, 1, 8, dtype=torch.float64) for _ in range(3))
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, 16, 32,
                                               torch.tensor([10, 16], dtype=torch.int32))
    keep = torch.cat([torch.arange(10), torch.arange(16, 32)])
    want = torch.softmax(q[0, :, 0] @ k[0, keep, 0].T * 8 ** -0.5, -1) @ v[0, keep, 0]
    assert torch.allclose(masked_attention(q, k, v, layout)[0, :, 0], want)
    assert not layout.token_mask()[0, 0, :, 10:16].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "hq", "hkv", "seq", "dim", "block"), [
    (1, 4, 4, 1000, 128, 128), (2, 4, 2, 777, 64, 64), (1, 3, 1, 515, 128, 64),
])
def test_gpu_matches_float64(dtype, b, hq, hkv, seq, dim, block):
    from sglx.attention.kernels.block_sparse_attention import BlockSparseConfig, block_sparse_attention

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, seq, h, dim, device="cuda").to(dtype) for h in (hq, hkv, hkv))
    nb = -(-seq // block)
    mask = torch.rand(b, hq, nb, nb, device="cuda") < 0.4
    mask[..., 0] = True
    mask[:, :, -1] = False  # an empty row
    lengths = torch.randint(1, block + 1, (nb,), device="cuda", dtype=torch.int32)
    lengths[-1] = min(int(lengths[-1]), seq - (nb - 1) * block)
    for k_lengths in (None, lengths):
        layout = BlockSparseLayout.from_block_mask(mask, block, block, seq, k_lengths)
        want = masked_attention(q.double(), k.double(), v.double(), layout)
        head_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # SVG2's permuted views
        for config in (BlockSparseConfig(), BlockSparseConfig(tma=False), BlockSparseConfig(tma=True)):
            for qkv in ((q, k, v), head_major):  # the default, plain loads and TMA; token- and head-major K/V
                got = block_sparse_attention(*qkv, layout, config=config)
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err <= 2e-2, (config, err)
