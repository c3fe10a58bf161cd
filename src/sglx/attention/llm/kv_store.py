"""Writing a step's K/V into the paged pool, shared by every backend that reads the pool in place.

One store path means one fp8 encoding: triton, fa3/fa4, flashinfer and trtllm_mha all write the pool with
sglx's Triton store kernel (static or per-token scales, whichever the pool holds; static scales still to be
calibrated are computed here from the first prefill), and all fold the store into the rotary kernel the same way
(not where keys are rotated or scales are pending: the fused kernel does neither).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglx.attention.kernels.store_kv import store_kv_to_pool
from sglx.attention.llm.base import LayerSpec
from sglx.llm.forward_batch import ForwardBatch


def calibrate_from_first_prefill(pool, layer_id: int, k: torch.Tensor, v: torch.Tensor,  # noqa: ANN001
                                 batch: ForwardBatch) -> None:
    """Freeze the layer's static fp8 scales from this step's K/V when they are still pending (vLLM's
    `--calculate-kv-scales`): only from a prefill step, never from a decode step or a CUDA-graph capture (whose
    K/V are padding; the runner captures its graphs after the scales are frozen)."""
    if not getattr(pool, "calibrating", False) or batch.mode.is_decode:
        return
    if k.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    pool.calibrate_layer(layer_id, k, v)


def store_step_kv(k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, batch: ForwardBatch,
                  kernel_on_cpu: bool = False) -> None:
    """k/v [T, Hkv*D] or [T, Hkv, D] -> the pool at `batch.out_cache_loc`.

    The Triton store kernel runs on CUDA tensors, and on CPU ones only when `kernel_on_cpu` (the triton
    backend under the interpreter); otherwise CPU tensors go through the pool's own `set_kv`.
    """
    k = k.reshape(k.shape[0], layer.num_kv_heads, -1)
    v = v.reshape(v.shape[0], layer.num_kv_heads, -1)
    pool = batch.token_kv_pool
    calibrate_from_first_prefill(pool, layer.layer_id, k, v, batch)
    if not (k.is_cuda or kernel_on_cpu):
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        return
    store_kv_to_pool(pool, layer.layer_id, k, v, batch.out_cache_loc)


@dataclass(frozen=True)
class StepKVSlots:
    """Where this step's K/V go in a layer's pool, for a kernel that computes them to store them on the way (the
    rotary kernel, the batch-1 qkv GEMV): buffers [slots, Hkv, D], the slots, the static fp8 scales and format."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor
    k_scale: float
    v_scale: float
    fp8_dtype: torch.dtype | None


def step_kv_slots(layer: LayerSpec, batch: ForwardBatch) -> StepKVSlots | None:
    """The layer's slots for a fused store, or None where only store_kv_to_pool may write (per-token fp8 scales,
    the key rotation, static scales still to be calibrated from the first prefill)."""
    pool = batch.token_kv_pool
    if getattr(pool, "per_token_scales", False) or getattr(pool, "k_rotation", None) is not None:
        return None
    if getattr(pool, "calibrating", False):
        return None
    i = layer.layer_id
    return StepKVSlots(pool.k_buffer[i], pool.v_buffer[i], batch.out_cache_loc, float(pool.k_scale[i]),
                       float(pool.v_scale[i]),
                       pool.layer_fp8_dtype(i) if hasattr(pool, "layer_fp8_dtype") else pool.fp8_dtype)


def rotary_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: StepKVSlots) -> bool:
    """Rotary on q/k in place with the K/V store to `slots` folded in (one launch per layer); False where the
    fused kernel does not apply (CPU tensors, mixed dtypes): the caller rotates and the backend stores."""
    from sglx.llm.kernels import use_fused

    if not (use_fused(q) and q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype):
        return False
    from sglx.llm.kernels.rotary import apply_rotary_and_store_

    apply_rotary_and_store_(q, k, v.reshape(v.shape[0], k.shape[1], -1), cos, sin, slots.k_buffer, slots.v_buffer,
                            slots.loc, slots.k_scale, slots.v_scale, slots.fp8_dtype)
    return True
