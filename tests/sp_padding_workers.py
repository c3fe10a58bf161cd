"""Worker functions for the sequence-parallel padding tests (latent token counts that do not divide by the ranks)."""

from __future__ import annotations

from typing import Any

import torch

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sdpa import TorchSDPABackend
from sglx.diffusion.parallel.attention import SequenceParallelBackend
from sglx.diffusion.parallel.collectives import gather_seq
from sglx.diffusion.parallel.degrees import SPDegrees
from sglx.diffusion.parallel.groups import sp_groups
from sglx.diffusion.parallel.sharding import padded_len
from sglx.distributed.group import destroy_distributed, init_distributed
from sp_workers import model_frames, sdpa64

ODD_GRID = (1, 3, 3)  # 9 latent tokens: 5 + 4 (one padded) at 2 ranks
HEADS, DIM, BATCH = 4, 16, 2


def _pad_shard(x: torch.Tensor, text: int, prefix: bool, rank: int, world: int) -> torch.Tensor:
    """This rank's input as the pipeline hooks make it: all text tokens plus its chunk of the zero-padded latents.
    The padding is filled with large values here: a padded key that was not left out would change every output."""
    n = x.shape[1]
    txt, img = (x[:, :text], x[:, text:]) if prefix else (x[:, n - text:], x[:, :n - text])
    pad = padded_len(img.shape[1], world) - img.shape[1]
    img = torch.cat([img, torch.full_like(img[:, :1], 30.0).expand(-1, pad, -1, -1)], dim=1)
    img = img.chunk(world, dim=1)[rank]
    return torch.cat([txt, img] if prefix else [img, txt], dim=1)


def padded_attention_cases(rank: int, world: int, splits: list[tuple[int, int]]) -> dict[str, float]:
    """Per split and text layout: max |SP output - float64 SDPA| over the real tokens, with a padded grid."""
    torch.set_num_threads(1)
    init_distributed(device="cpu")
    try:
        out: dict[str, float] = {}
        for u, r in splits:
            groups = sp_groups(SPDegrees(u, r))
            for i, (name, text, pos) in enumerate([("dense", 0, "none"), ("prefix_text", 6, "prefix"),
                                                    ("suffix_text", 5, "suffix")]):
                meta = DiTAttnMetadata(grid=ODD_GRID, num_heads=HEADS, head_dim=DIM, text_tokens=text,
                                       text_position=pos)
                gen = torch.Generator().manual_seed(i)
                q, k, v = (torch.randn(BATCH, meta.seq_len, HEADS, DIM, generator=gen) for _ in range(3))
                prefix = pos == "prefix"
                local = [_pad_shard(t, text, prefix, rank, world) for t in (q, k, v)]
                res = SequenceParallelBackend(TorchSDPABackend(), groups).forward(*local, meta=meta, layer=0)
                n = res.shape[1]
                txt, img = (res[:, :text], res[:, text:]) if prefix else (res[:, n - text:], res[:, :n - text])
                img = gather_seq(img)[:, :meta.image_tokens]
                full = torch.cat([txt, img] if prefix else [img, txt], dim=1)
                out[f"u{u}r{r}_{name}"] = float((full.double() - sdpa64(q, k, v)).abs().max())
        return out
    finally:
        destroy_distributed()


def padded_pipeline_cases(rank: int, world: int, cases: list[tuple[str, str, dict[str, Any], int, int]]
                          ) -> dict[str, Any]:
    """Per named case (model dir, request, ulysses, ring): rank 0's float frames and the tokens each rank's DiT saw."""
    torch.set_num_threads(1)
    init_distributed(device="cpu")
    try:
        out: dict[str, Any] = {}
        for name, model_dir, request, u, r in cases:
            frames, tokens = model_frames(model_dir, request, "cpu", ulysses_degree=u, ring_degree=r)
            out[name], out[name + "_tokens"] = frames.cpu().numpy(), tokens
        return out
    finally:
        destroy_distributed()
