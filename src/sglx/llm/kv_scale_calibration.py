"""Per-layer fp8 KV scales computed from the first K/V a layer stores, then frozen (vLLM's `--calculate-kv-scales`).

For backends whose kernels take one K and one V scale per layer (FlashInfer, TRT-LLM XQA) when the checkpoint
brings none. vLLM's rule: scale = amax(first batch) / range, with range 200 for K and 100 for V (its
`K_SCALE_CONSTANT` / `V_SCALE_CONSTANT`), i.e. the first batch's largest value lands at 200 (K) or 100 (V) of
e4m3's 448, leaving 2.2x / 4.5x headroom for later tokens larger than the first batch's (values beyond the
format's largest saturate). Keys are rotated first when the pool rotates them (`TokenKVPool.k_rotation`), so
the amax is the rotated keys' amax.

Why the rotation (embedded model, fp8_e4m3, torch_native over such a pool, 2 x 200 prompts, docs/benchmarks.md):
1.0 per layer 52-54%, calibrated 58-59.5%, 1.0 over rotated keys 81-82.5%, calibrated over rotated keys 85-88.5%.
A per-layer scale only moves the fp8 grid (e4m3's relative rounding error is the same at any scale); rotated keys
average each score's rounding error over all channels instead of a few large ones. Per-token scales (triton,
torch_native) reach 98.5-99.5%; for per-layer-scale backends the rest of the loss is in one layer, which
`--kv-cache-dtype-skip-layers 1` keeps in the model dtype (`TokenKVPool.keep_unquantized`): 100% of 2 x 200 prompts.
Static per-channel scales, mean shifts or a query-aware linear key transform folded outside the kernel do not help
(53-88.5%, benchmarks/recall_fp8_folded_scales.py): e4m3's rounding error is relative, the same at any scale.
"""

from __future__ import annotations

import torch

K_RANGE = 200.0
"""The first batch's largest |K| is stored as this value (vLLM's K_SCALE_CONSTANT)."""
V_RANGE = 100.0
"""The first batch's largest |V| is stored as this value (vLLM's V_SCALE_CONSTANT)."""
MIN_SCALE = 2.0 ** -24
"""Floor for an all-zero first batch (a finite scale; later values then saturate, as in vLLM)."""


def first_batch_scale(x: torch.Tensor, value_range: float) -> float:
    """amax(|x|) / value_range as a Python float (one host sync per layer, once)."""
    if x.numel() == 0:
        raise ValueError("cannot calibrate a KV scale from an empty batch")
    return max(float(x.detach().abs().amax().float()) / value_range, MIN_SCALE)

