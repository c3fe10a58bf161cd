"""The triton MLA backend and its split-KV latent decode kernel, on CPU through the Triton interpreter.

The cases (tests/triton_interpreted/mla_cases.py) run in a child pytest with TRITON_INTERPRET=1, which must
be set before the kernels are defined and must not leak into this process.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interpreted.launch import run_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_mla_matches_float64_under_the_interpreter():
    run_interpreted("mla_cases.py")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gluon_stage1_is_chosen_only_where_it_fits_and_refused_clearly_elsewhere():
    """The Gluon MLA kernel (SM90, 16-bit latents of 512 + 64, the 64-head launch): never picked on a CPU, and
    asking for it there names what it needs instead of failing inside a compiler."""
    import torch

    from sglx.attention.kernels.mla_decode import MLADecodeConfig, use_gluon, wide_launch

    q = torch.zeros(2, 128, 512, dtype=torch.bfloat16)
    kv = torch.zeros(16, 1, 576, dtype=torch.bfloat16)
    wide = wide_launch()
    assert not use_gluon(q, kv, 512, 64, wide, None)
    assert not use_gluon(q, kv, 512, 64, wide_launch(MLADecodeConfig(gluon=False)), None)
    with pytest.raises(ValueError, match=r"SM90 GPUs, bf16/fp16 queries over latents of 512 \+ 64 .* got cpu"):
        use_gluon(q, kv, 512, 64, wide_launch(MLADecodeConfig(gluon=True)), None)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_seesaw_kernel_asked_for_where_it_cannot_run_is_refused_clearly():
    """MLADecodeConfig(seesaw=True) on a CPU names what the warp-specialised Gluon kernel needs."""
    import torch

    from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_decode_attention

    q = torch.randn(2, 128, 576)
    kv = torch.randn(16, 1, 576)
    with pytest.raises(ValueError, match="seesaw runs on the Gluon route with 16-bit latents .* got cpu"):
        mla_decode_attention(q, kv, torch.empty(2, 128, 512), torch.tensor([0, 8, 16], dtype=torch.int32),
                             torch.arange(16, dtype=torch.int32), torch.empty(2, 128, 1, 512), torch.empty(2, 128, 1),
                             0.1, 512, config=MLADecodeConfig(seesaw=True))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_wide_launch_splits_never_start_a_partial_second_wave():
    """The 64-head launch runs one program per SM, so its split count rounds down: batch x 2 head blocks x splits
    stays within the SMs (the counts that measured fastest on the H200 in session 19), a split keeps at least 128
    keys, 60+ requests take one split, and an explicit num_splits wins."""
    from dataclasses import replace

    from sglx.attention.kernels.mla_decode import MLADecodeConfig, mla_num_splits, wide_launch

    wide = wide_launch()
    assert [mla_num_splits(bs, 128, 4096, 132, wide) for bs in (1, 2, 4, 8, 16, 32)] == [32, 32, 16, 8, 4, 2]
    assert all(bs * 2 * mla_num_splits(bs, 128, 4096, 132, wide) <= 132 for bs in range(1, 67))
    assert mla_num_splits(1, 128, 1024, 132, wide) == 8  # 1024 keys in 128-key splits
    assert mla_num_splits(60, 128, 4096, 132, wide) == 1
    assert mla_num_splits(4, 128, 4096, 132, replace(wide, num_splits=17)) == 17
    assert mla_num_splits(4, 128, 4096, 132, wide_launch(MLADecodeConfig(min_chunk=64))) == 16


def test_merge_programs_grow_to_their_tile_while_the_grid_still_covers_the_sms():
    """Stage 2's program shape: the 128-head calls of the H200 profile (B16 x 4 splits took 25 us as 8,192
    one-head 128-column programs) get whole 512-wide rows and up to 8 heads a program, within MERGE_TILE floats
    and never fewer programs than SMs; a 16-head batch-1 call (DeepSeek-V2-Lite) keeps one head and 128 columns,
    where any larger program would leave SMs idle."""
    import triton

    from sglx.attention.kernels.mla_decode import MERGE_TILE, merge_launch

    assert merge_launch(16, 128, 512, 4, 132) == (4, 512)
    assert merge_launch(32, 128, 512, 2, 132) == (8, 512)
    assert merge_launch(4, 128, 512, 16, 132) == (1, 512)
    assert merge_launch(1, 128, 512, 32, 132) == (1, 256)
    assert merge_launch(1, 16, 512, 32, 132) == (1, 128)
    for bs in (1, 2, 3, 8, 16, 32, 48):
        for h, block_s in ((16, 32), (20, 4), (128, 8), (128, 64)):
            hm, dv = merge_launch(bs, h, 512, block_s, 132)
            start = bs * h * 4  # programs of one head and 128 columns
            assert block_s * hm * dv <= max(MERGE_TILE, block_s * 128)
            assert bs * triton.cdiv(h, hm) * triton.cdiv(512, dv) >= min(start, 132)
