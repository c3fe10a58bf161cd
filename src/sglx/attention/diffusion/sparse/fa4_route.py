"""The same block-sparse attention through FA4's block-sparse path (flash-attn-4, `flash_attn.cute`).

FA4 takes per-(batch, head, query block) lists of key blocks as `BlockSparseTensorsTorch`: "mask" blocks
(a mask_mod applies) and "full" blocks (none). Our lists are all full blocks. FA4 masks the sequence tail
only in the first block it processes, which is the last one listed, so rows are sorted ascending when the
last key block is partial. Padding inside blocks (`k_lengths`) would need a mask_mod, so such layouts stay
on the Triton kernel. Imported only when used; Hopper (SM90) FA4 tiles are 128x128 for head dim 64/128.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout

FA4_BLOCK = 128


@functools.lru_cache(maxsize=1)
def fa4_modules() -> tuple[Any, Any] | None:
    """(flash_attn_func, BlockSparseTensorsTorch), or None where flash-attn-4 is missing or broken."""
    try:
        cute = importlib.import_module("flash_attn.cute")
        sparsity = importlib.import_module("flash_attn.cute.block_sparsity")
        return cute.flash_attn_func, sparsity.BlockSparseTensorsTorch
    except (ImportError, OSError, RuntimeError, AttributeError):
        return None


def fa4_supports(q: torch.Tensor, layout: BlockSparseLayout) -> str | None:
    """None when FA4's block-sparse path can run this call; else why not (shown with the route pick)."""
    if q.device.type != "cuda" or torch.version.hip:
        return "FA4 runs on NVIDIA GPUs"
    if torch.cuda.get_device_capability(q.device)[0] not in (9, 10):
        return "FA4 block-sparse needs SM90 or SM10x"
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] not in (64, 128):
        return "FA4 route takes fp16/bf16 at head dim 64/128"
    if layout.q_block != FA4_BLOCK or layout.k_block != FA4_BLOCK:
        return f"FA4 route takes {FA4_BLOCK}x{FA4_BLOCK} blocks; layout has {layout.q_block}x{layout.k_block}"
    if layout.k_lengths is not None:
        return "layout has padded key blocks (needs a mask_mod)"
    if fa4_modules() is None:
        return "flash-attn-4 (flash_attn.cute) is not installed or fails to import"
    return None


_TENSORS: dict[int, tuple[BlockSparseLayout, Any]] = {}  # id(layout) -> (layout kept alive, FA4 tensors)


def _fa4_tensors(layout: BlockSparseLayout) -> Any:
    hit = _TENSORS.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    if len(_TENSORS) >= 256:
        _TENSORS.clear()
    tensors = _build_tensors(layout)
    _TENSORS[id(layout)] = (layout, tensors)
    return tensors


def _build_tensors(layout: BlockSparseLayout) -> Any:
    _, tensors_cls = fa4_modules()  # type: ignore[misc]
    idx, cnt = layout.kv_indices, layout.kv_counts
    if layout.seq_len % layout.k_block:  # the partial tail block must be listed last (processed first)
        big = torch.iinfo(torch.int32).max
        idx = torch.sort(torch.where(idx < 0, big, idx), dim=-1).values
        idx = torch.where(idx == big, -1, idx).to(torch.int32)
    empty_cnt = torch.zeros_like(cnt)
    empty_idx = torch.zeros(*cnt.shape, 1, dtype=torch.int32, device=cnt.device)
    return tensors_cls(mask_block_cnt=empty_cnt, mask_block_idx=empty_idx, full_block_cnt=cnt.contiguous(),
                       full_block_idx=idx.contiguous(), block_size=(layout.q_block, layout.k_block))


def fa4_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                               scale: float | None = None) -> torch.Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D] through FA4 (call `fa4_supports` first)."""
    func, _ = fa4_modules()  # type: ignore[misc]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = func(q, k, v, softmax_scale=scale, causal=False, block_sparse_tensors=_fa4_tensors(layout))
    return out[0] if isinstance(out, tuple) else out
