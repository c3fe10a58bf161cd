"""The same block-sparse attention through FA4's block-sparse path (flash-attn-4, `flash_attn.cute`).

FA4 takes per-(batch, head, query block) lists of key blocks as `BlockSparseTensorsTorch`: "mask" blocks
(a mask_mod applies) and "full" blocks (none). Blocks without padding go to the full lists. FA4 masks the
sequence tail only in the first block it processes, which is the last one listed, so rows are sorted
ascending when the last key block is partial. Blocks with padding keys (`k_lengths`) go to the mask lists
with a mask_mod that reads a per-key validity vector (an aux tensor); measured on H100 against float64 (Wan
21x30x52 grid: relative error 2.3e-3, 3.46 ms vs 7.49 ms for the Triton kernel). PADDED_ENV=0 turns it off.
Imported only when used. FA4's tiles are 128x128 for head dim 64/128; on Hopper (SM90) flash-attn-4 4.0.0b36 and
later also fit its tiles to smaller sparse blocks (`_fit_sm90_fwd_tile_to_block_sparsity`: query blocks of 64,
key blocks of 16-128), which VSA's 64-token cubes and VMoBA's 64-token blocks use.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout

FA4_BLOCK = 128
PADDED_ENV = "SGLX_FA4_PADDED"  # "0": layouts with padded key blocks stay on the Triton kernel


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
    why_not = _block_shape_refused(torch.cuda.get_device_capability(q.device)[0], layout)
    if why_not is not None:
        return why_not
    if layout.k_lengths is not None and os.environ.get(PADDED_ENV) == "0":
        return f"layout has padded key blocks and {PADDED_ENV}=0"
    if fa4_modules() is None:
        return "flash-attn-4 (flash_attn.cute) is not installed or fails to import"
    return None


def _block_shape_refused(major: int, layout: BlockSparseLayout) -> str | None:
    """None when FA4 tiles this layout's blocks: 128x128 everywhere; on SM90, with a flash-attn-4 that fits its
    tiles to the sparse blocks, query blocks of a multiple of 64 and key blocks of 16-128 in steps of 16."""
    qb, kb = layout.q_block, layout.k_block
    if qb == kb == FA4_BLOCK:
        return None
    if major == 9 and qb % 64 == 0 and kb % 16 == 0 and 16 <= kb <= FA4_BLOCK:
        if fits_small_blocks():
            return None
        return (f"{qb}x{kb} blocks need flash-attn-4 >= 4.0.0b36 (fits SM90 tiles to sparse blocks); this one "
                f"takes {FA4_BLOCK}x{FA4_BLOCK} only")
    return f"FA4 route takes {FA4_BLOCK}x{FA4_BLOCK} blocks here; layout has {qb}x{kb}"


@functools.lru_cache(maxsize=1)
def fits_small_blocks() -> bool:
    """Whether the installed flash-attn-4 shrinks its SM90 forward tiles to fit smaller sparse blocks."""
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except (ImportError, OSError, RuntimeError, AttributeError):
        return False
    return hasattr(interface, "_fit_sm90_fwd_tile_to_block_sparsity")


_TENSORS: dict[int, tuple[BlockSparseLayout, Any, Any]] = {}  # id(layout) -> (layout, FA4 tensors, aux)


@functools.lru_cache(maxsize=1)
def padding_mask_mod() -> Any:
    """A CuTe mask_mod keeping key `n` iff aux_tensors[0][n] (int32 per key slot) is nonzero."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def key_is_real(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):  # type: ignore[no-untyped-def]
        valid = aux_tensors[0]
        flag = utils.scalar_to_ssa(valid[n_idx[0]], cutlass.Int32)
        return flag > utils.scalar_to_ssa(0, cutlass.Int32)

    return key_is_real


def _fa4_tensors(layout: BlockSparseLayout) -> tuple[Any, Any]:
    """(BlockSparseTensorsTorch, aux validity tensor or None), built once per layout."""
    hit = _TENSORS.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1], hit[2]
    if len(_TENSORS) >= 256:
        _TENSORS.clear()
    tensors, aux = _build_tensors(layout)
    _TENSORS[id(layout)] = (layout, tensors, aux)
    return tensors, aux


def _ascending(idx: torch.Tensor) -> torch.Tensor:
    big = torch.iinfo(torch.int32).max
    idx = torch.sort(torch.where(idx < 0, big, idx), dim=-1).values
    return torch.where(idx == big, -1, idx).to(torch.int32)


def _split(idx: torch.Tensor, cnt: torch.Tensor, take: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed blocks where `take[block]`, packed left (order kept): (counts, indices)."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1)
    keep = listed & take[idx.clamp(min=0).long()]
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    packed = torch.gather(idx, -1, order)
    counts = keep.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    valid = torch.arange(width, device=idx.device) < counts.unsqueeze(-1)
    return counts.contiguous(), torch.where(valid, packed[..., :width], -1).to(torch.int32).contiguous()


def _build_tensors(layout: BlockSparseLayout) -> tuple[Any, Any]:
    _, tensors_cls = fa4_modules()  # type: ignore[misc]
    idx, cnt = layout.kv_indices, layout.kv_counts
    if layout.seq_len % layout.k_block:  # the partial tail block must be listed last (processed first)
        idx = _ascending(idx)
    size = (layout.q_block, layout.k_block)
    if layout.k_lengths is None:
        empty_cnt = torch.zeros_like(cnt)
        empty_idx = torch.zeros(*cnt.shape, 1, dtype=torch.int32, device=cnt.device)
        return tensors_cls(mask_block_cnt=empty_cnt, mask_block_idx=empty_idx, full_block_cnt=cnt.contiguous(),
                           full_block_idx=idx.contiguous(), block_size=size), None
    padded = layout.k_lengths.to(idx.device) < layout.k_block
    mask_cnt, mask_idx = _split(idx, cnt, padded)
    full_cnt, full_idx = _split(idx, cnt, ~padded)
    aux = layout.key_valid().to(device=idx.device, dtype=torch.int32).contiguous()
    return tensors_cls(mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
                       full_block_idx=full_idx, block_size=size), aux


def fa4_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                               scale: float | None = None) -> torch.Tensor:
    """q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D] through FA4 (call `fa4_supports` first)."""
    func, _ = fa4_modules()  # type: ignore[misc]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    tensors, aux = _fa4_tensors(layout)
    if aux is None:
        out = func(q, k, v, softmax_scale=scale, causal=False, block_sparse_tensors=tensors)
    else:
        out = func(q, k, v, softmax_scale=scale, causal=False, block_sparse_tensors=tensors,
                   mask_mod=padding_mask_mod(), aux_tensors=[aux])
    return out[0] if isinstance(out, tuple) else out
