"""Block masks to key-block lists without sorting: what data-dependent backends (VMoBA, SVG2) build every call.

`BlockSparseLayout.from_block_mask` sorts each [num_k_blocks] row; here every kept column is scattered to its
rank among the kept ones (a cumulative sum), linear in the mask's size. Same lists: ascending, -1 after.
"""

from __future__ import annotations

import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout


def layout_from_mask(mask: torch.Tensor, q_block: int, k_block: int, seq_len: int,
                     k_lengths: torch.Tensor | None = None) -> BlockSparseLayout:
    """bool [B, H, num_q_blocks, num_k_blocks] -> the layout listing the True columns of every row."""
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    rank = torch.where(mask, mask.cumsum(-1) - 1, width)  # dropped columns go to a spare slot
    cols = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int32).expand(mask.shape)
    lists = torch.full((*mask.shape[:-1], width + 1), -1, dtype=torch.int32, device=mask.device)
    lists.scatter_(-1, rank, cols)
    return BlockSparseLayout(q_block, k_block, seq_len, lists[..., :width].contiguous(), counts, k_lengths)


__all__ = ["layout_from_mask"]
