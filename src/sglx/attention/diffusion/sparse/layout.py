"""The contract between sparse mask builders and block-sparse kernels.

The sequence (after any token permutation a backend applies: tile order for STA, cluster order for SVG2) is
cut into query blocks of `q_block` tokens and key blocks of `k_block` tokens; the last block of each may be
partial (`seq_len` says where tokens end). For each (batch row, head, query block) the layout lists the key
blocks to attend: `kv_indices[b, h, i, :kv_counts[b, h, i]]`, each index in [0, num_k_blocks), the rest of
the row unused (filled with -1). Batch and head dimensions may be 1 to broadcast (STA masks are the same for
every batch row; VSA/SVG2 masks depend on the data). Joint text tokens are ordinary blocks whose rows list
every key block and that every query block lists.

`k_lengths` (optional, int32 [num_k_blocks]) gives the number of real keys at the start of each key block;
the rest of the block is padding that is never attended (STA pads edge tiles of a grid that does not divide
by the tile to whole blocks). None means every key block is full except the last, cut by `seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockSparseLayout:
    q_block: int
    k_block: int
    seq_len: int  # query and key length (self-attention)
    kv_indices: torch.Tensor  # int32 [B or 1, H or 1, num_q_blocks, max_kv]
    kv_counts: torch.Tensor  # int32 [B or 1, H or 1, num_q_blocks]
    k_lengths: torch.Tensor | None = None  # int32 [num_k_blocks]: real keys per key block (padding after)

    def __post_init__(self) -> None:
        if self.kv_indices.dim() != 4 or self.kv_counts.dim() != 3:
            raise ValueError("kv_indices must be [B, H, num_q_blocks, max_kv] and kv_counts [B, H, num_q_blocks]")
        if tuple(self.kv_indices.shape[:3]) != tuple(self.kv_counts.shape):
            raise ValueError(f"kv_indices {tuple(self.kv_indices.shape)} and kv_counts "
                             f"{tuple(self.kv_counts.shape)} disagree")
        if self.kv_indices.shape[2] != self.num_q_blocks:
            raise ValueError(f"{self.kv_indices.shape[2]} query-block rows for {self.num_q_blocks} query blocks")
        if self.k_lengths is not None and tuple(self.k_lengths.shape) != (self.num_k_blocks,):
            raise ValueError(f"k_lengths must be [{self.num_k_blocks}] (one per key block); got "
                             f"{tuple(self.k_lengths.shape)}")

    @property
    def num_q_blocks(self) -> int:
        return cdiv(self.seq_len, self.q_block)

    @property
    def num_k_blocks(self) -> int:
        return cdiv(self.seq_len, self.k_block)

    def density(self) -> float:
        """Share of (query block, key block) pairs computed, averaged over batch rows and heads."""
        return float(self.kv_counts.float().mean()) / self.num_k_blocks

    def block_mask(self) -> torch.Tensor:
        """bool [B, H, num_q_blocks, num_k_blocks]: True where the query block attends the key block."""
        b, h, nq, width = self.kv_indices.shape
        mask = torch.zeros(b, h, nq, self.num_k_blocks + 1, dtype=torch.bool, device=self.kv_indices.device)
        valid = torch.arange(width, device=self.kv_indices.device) < self.kv_counts.unsqueeze(-1)
        target = torch.where(valid, self.kv_indices.long(), torch.full_like(self.kv_indices.long(),
                                                                              self.num_k_blocks))
        mask.scatter_(-1, target, True)
        return mask[..., : self.num_k_blocks]

    def token_mask(self) -> torch.Tensor:
        """bool [B, H, seq_len, seq_len]: the same mask token by token (for references and small tests)."""
        blocks = self.block_mask()
        rows = torch.arange(self.seq_len, device=blocks.device) // self.q_block
        cols = torch.arange(self.seq_len, device=blocks.device) // self.k_block
        return blocks[:, :, rows][:, :, :, cols] & self.key_valid().to(blocks.device)

    def key_valid(self) -> torch.Tensor:
        """bool [seq_len]: False for padding keys (those past `k_lengths` of their block)."""
        pos = torch.arange(self.seq_len, device=self.kv_indices.device)
        if self.k_lengths is None:
            return torch.ones(self.seq_len, dtype=torch.bool, device=pos.device)
        lengths = self.k_lengths.to(pos.device).long()
        return pos % self.k_block < lengths[pos // self.k_block]

    @classmethod
    def from_block_mask(cls, mask: torch.Tensor, q_block: int, k_block: int, seq_len: int,
                        k_lengths: torch.Tensor | None = None) -> BlockSparseLayout:
        """Lists from a bool block mask [B, H, num_q_blocks, num_k_blocks] (ascending key-block order)."""
        counts = mask.sum(-1).to(torch.int32)
        width = max(int(counts.max()) if counts.numel() else 0, 1)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]
        valid = torch.arange(width, device=mask.device) < counts.unsqueeze(-1)
        indices = torch.where(valid, order, torch.full_like(order, -1)).to(torch.int32)
        return cls(q_block, k_block, seq_len, indices.contiguous(), counts.contiguous(), k_lengths)
