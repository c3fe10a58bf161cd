"""`AttentionBackend.step_kv_slots`: which backends let a kernel that computes this step's K/V (rotary, the batch-1 qkv
GEMV) store them itself, and for which pools they must not (per-token fp8 scales and the key rotation, static scales
still to be calibrated: only sglx's store path writes those)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglx.attention.llm.base import LayerSpec
from sglx.attention.llm.kv_store import StepKVSlots, step_kv_slots
from sglx.llm.kv_cache import TokenKVPool

SPEC = LayerSpec(layer_id=1, num_q_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)


def _batch(pool: TokenKVPool) -> SimpleNamespace:
    return SimpleNamespace(token_kv_pool=pool, out_cache_loc=torch.tensor([7]))


def test_slots_point_at_the_layers_buffers_and_scales():
    pool = TokenKVPool(32, 1, 2, 2, 16, torch.bfloat16, "fp8_e4m3")
    pool.k_scale[1], pool.v_scale[1] = 0.5, 0.25
    batch = _batch(pool)
    slots = step_kv_slots(SPEC, batch)
    assert isinstance(slots, StepKVSlots)
    assert slots.k_buffer is pool.k_buffer[1] and slots.v_buffer is pool.v_buffer[1]
    assert slots.loc is batch.out_cache_loc
    assert (slots.k_scale, slots.v_scale, slots.fp8_dtype) == (0.5, 0.25, pool.fp8_dtype)
    assert step_kv_slots(SPEC, _batch(TokenKVPool(32, 1, 2, 2, 16, torch.bfloat16))).fp8_dtype is None


@pytest.mark.parametrize("why", ["per_token_scales", "calibrating"])
def test_no_slots_where_only_the_store_path_may_write(why):
    pool = TokenKVPool(32, 1, 2, 2, 16, torch.bfloat16, "fp8_e4m3", per_token_scales=why == "per_token_scales")
    pool.calibrating = why == "calibrating"
    assert step_kv_slots(SPEC, _batch(pool)) is None


def test_backends_that_write_sglx_pools_lend_their_slots():
    from sglx.attention.llm.fa4 import FA4Backend
    from sglx.attention.llm.flashinfer import FlashInferBackend
    from sglx.attention.llm.flex import FlexAttentionBackend
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.attention.llm.triton import TritonBackend

    assert all(b.lends_pool_slots for b in (TritonBackend, FlashInferBackend, FA4Backend))
    assert not any(b.lends_pool_slots for b in (TorchNativeBackend, FlexAttentionBackend))
    pool = TokenKVPool(32, 1, 2, 2, 16, torch.bfloat16)
    lender, keeper = object.__new__(TritonBackend), object.__new__(TorchNativeBackend)  # the hook reads no state
    assert isinstance(lender.step_kv_slots(SPEC, _batch(pool)), StepKVSlots)
    assert keeper.step_kv_slots(SPEC, _batch(pool)) is None
