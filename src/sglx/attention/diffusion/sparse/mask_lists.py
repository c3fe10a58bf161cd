"""Block masks to key-block lists without sorting: what data-dependent backends (VMoBA, SVG2) build every call.

`BlockSparseLayout.from_block_mask` sorts each [num_k_blocks] row; here every kept column is scattered to its
rank among the kept ones (a cumulative sum), linear in the mask's size. Same lists: ascending, -1 after.
"""

from __future__ import annotations

import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout


def layout_from_mask(mask: torch.Tensor, q_block: int, k_block: int, seq_len: int,
                     k_lengths: torch.Tensor | None = None, width: int | None = None) -> BlockSparseLayout:
    """bool [B, H, num_q_blocks, num_k_blocks] -> the layout listing the True columns of every row.

    `width`: the lists' length (at least the most True columns of a row; num_k_blocks always is). Given, nothing
    is read back to the host (a GPU caller's plan then never waits); None: the longest row's count, read back."""
    counts = mask.sum(-1, dtype=torch.int32)
    if width is None:
        width = max(int(counts.max()) if counts.numel() else 0, 1)
    cols = mask.shape[-1]
    kept = mask.cumsum(-1)  # kept columns up to and including each column
    if width >= cols:  # a stable partition: kept columns first (ascending), then the dropped ones as -1
        ramp = torch.arange(cols, device=mask.device)
        pos = torch.where(mask, kept - 1, counts[..., None].long() + ramp - kept)
        lists = torch.empty(*mask.shape[:-1], cols, dtype=torch.int32, device=mask.device)
        lists.scatter_(-1, pos, torch.where(mask, ramp.to(torch.int32), -1))
        if width > cols:
            lists = torch.nn.functional.pad(lists, (0, width - cols), value=-1)
        return BlockSparseLayout(q_block, k_block, seq_len, lists, counts, k_lengths)
    rank = torch.where(mask, kept - 1, width)  # dropped columns go to a spare slot
    ramp32 = torch.arange(cols, device=mask.device, dtype=torch.int32).expand(mask.shape)
    lists = torch.full((*mask.shape[:-1], width + 1), -1, dtype=torch.int32, device=mask.device)
    lists.scatter_(-1, rank, ramp32)
    return BlockSparseLayout(q_block, k_block, seq_len, lists[..., :width].contiguous(), counts, k_lengths)


__all__ = ["layout_from_mask"]
