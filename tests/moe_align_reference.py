"""moe_align's layout from torch operations (a stable argsort): the independent reference the align kernels are
checked against, and the torch baseline of benchmarks/bench_moe_align.py."""

from __future__ import annotations

import torch

from sglx.llm.kernels.moe_align import blocks_bound


def align_by_torch_sort(ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids, block experts, block rows) as moe_align lays them out; rows past an expert's pairs are -1
    here (moe_align leaves them unwritten, so compare only each block's real rows)."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    blocks = blocks_bound(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    first = counts.cumsum(0) - counts  # each expert's first position in the unpadded sorted order
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    dest = pad_start[expert] + torch.arange(pairs, device=device) - first[expert]
    sorted_ids = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    row0 = torch.arange(blocks, device=device) * block_m
    owner = torch.searchsorted(pad_end, row0, right=True)  # experts whose padded run ends at or before the block
    used = owner < num_experts
    mine = owner.clamp(max=num_experts - 1)
    rows = (counts[mine] - (row0 - pad_start[mine])).clamp(0, block_m)
    block_expert = torch.where(used, owner, -1).to(torch.int32)
    block_rows = torch.where(used, rows, 0).to(torch.int32)
    return sorted_ids, block_expert, block_rows


def assert_same_alignment(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], block_m: int) -> None:
    """Equal block experts and row counts, and equal pairs in every block's real rows."""
    assert torch.equal(got[1], want[1]), (got[1], want[1])
    assert torch.equal(got[2], want[2]), (got[2], want[2])
    for b, n in enumerate(want[2].tolist()):
        assert torch.equal(got[0][b * block_m:b * block_m + n], want[0][b * block_m:b * block_m + n]), b
