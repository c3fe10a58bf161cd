"""The process groups of one sequence-parallel DiT: Ulysses groups inside, ring groups across.

Global rank r = ring_rank * ulysses + ulysses_rank and holds sequence chunk r. A Ulysses group is `ulysses`
consecutive ranks, so its all-to-all gathers consecutive chunks into one contiguous super-chunk; a ring group
holds the ranks with the same Ulysses rank (the same heads), one super-chunk each, in sequence order.
Every rank must call `sp_groups` (torch.distributed.new_group is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from sglx.diffusion.parallel.degrees import SPDegrees, check_world


@dataclass(frozen=True)
class SPGroups:
    """This rank's place in the sequence-parallel layout, with the groups its collectives run in."""

    degrees: SPDegrees
    rank: int  # global rank = sequence chunk index
    ulysses_group: Any  # ProcessGroup, or None when ulysses == 1
    ring_group: Any  # ProcessGroup, or None when ring == 1
    ring_ranks: tuple[int, ...]  # global ranks of this rank's ring group, in ring (= sequence) order

    @property
    def world_size(self) -> int:
        return self.degrees.size

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.degrees.ulysses

    @property
    def ring_rank(self) -> int:
        return self.rank // self.degrees.ulysses


def sp_groups(degrees: SPDegrees) -> SPGroups:
    """Build the Ulysses and ring groups over the running default process group (world = ulysses x ring)."""
    if not degrees.active:
        return SPGroups(degrees, 0, None, None, (0,))
    if not dist.is_initialized():
        raise RuntimeError(f"{degrees.describe()} needs torch.distributed started (sglx.distributed.group)")
    check_world(degrees, dist.get_world_size())
    rank, u, r = dist.get_rank(), degrees.ulysses, degrees.ring
    ulysses_group = ring_group = None
    ring_ranks: tuple[int, ...] = (rank,)
    if u > 1:
        for i in range(r):  # every rank creates every group, in the same order
            ranks = list(range(i * u, (i + 1) * u))
            group = dist.new_group(ranks)
            if rank in ranks:
                ulysses_group = group
    if r > 1:
        for j in range(u):
            ranks = [j + i * u for i in range(r)]
            group = dist.new_group(ranks)
            if rank in ranks:
                ring_group, ring_ranks = group, tuple(ranks)
    return SPGroups(degrees, rank, ulysses_group, ring_group, ring_ranks)
