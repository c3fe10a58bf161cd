"""Dense attention under a block-sparse layout, in plain PyTorch: the reference every sparse kernel is tested
against (in float64) and the slow but correct path on CPU, so every sparse backend runs anywhere."""

from __future__ import annotations

import torch

from sglx.attention.diffusion.sparse.layout import BlockSparseLayout


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                     scale: float | None = None, chunk: int = 4096) -> torch.Tensor:
    """q, k, v [B, S, H, D] (Hq a multiple of Hkv) -> [B, S, H, D], attending only where the layout says.

    Query rows are processed `chunk` at a time so long sequences do not build an S x S mask at once. A query
    row with no key at all (an empty block list) returns zeros. Padding keys (`layout.k_lengths`) are never
    attended.
    """
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    if s != layout.seq_len or k.shape[1] != s:
        raise ValueError(f"layout is for {layout.seq_len} tokens, q/k have {s}/{k.shape[1]}")
    scale = d ** -0.5 if scale is None else scale
    blocks = layout.block_mask()  # [B|1, H|1, nq, nk]
    cols = torch.arange(s, device=q.device) // layout.k_block
    key_valid = layout.key_valid().to(q.device)
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    out = torch.empty_like(qt)
    for start in range(0, s, chunk):
        stop = min(s, start + chunk)
        rows = torch.arange(start, stop, device=q.device) // layout.q_block
        allowed = blocks[:, :, rows][:, :, :, cols] & key_valid  # [B|1, H|1, rows, S]
        scores = torch.matmul(qt[:, :, start:stop], kt.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[:, :, start:stop] = torch.matmul(probs.to(vt.dtype), vt)
    return out.transpose(1, 2)
