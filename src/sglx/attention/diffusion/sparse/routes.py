"""Which kernel runs a block-sparse call: FA4's block-sparse path, sglx's Triton kernel, or the masked reference.

All three give the same output (each is tested against the float64 masked reference). FA4 is preferred where
it runs with 128x128 blocks (Hopper/Blackwell, flash-attn-4 installed): on H100 it keeps dense FA4's efficiency.
Smaller blocks (VSA's 64-token cubes) FA4 runs on Hopper too, but no faster than the Triton kernel, which they
keep. The Triton kernel serves every other CUDA call; the reference serves CPU and other devices.
`pick_route` says which one and why, so backends and `sglx bench` can show the pick.
"""

from __future__ import annotations

import os

import torch

from sglx.attention.diffusion.sparse.fa4_route import FA4_BLOCK, fa4_block_sparse_attention, fa4_supports
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout
from sglx.attention.diffusion.sparse.reference import masked_attention

ROUTES = ("fa4", "triton", "reference")
ENV = "SGLX_BLOCK_SPARSE_ROUTE"  # force one route (fa4 | triton | reference), for benchmarks and tests


def pick_route(q: torch.Tensor, layout: BlockSparseLayout) -> tuple[str, str]:
    """(route, why) for this call."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in ROUTES:
            raise ValueError(f"{ENV}={forced!r}: choose one of {', '.join(ROUTES)}")
        return forced, f"{ENV}={forced}"
    if q.device.type != "cuda":
        return "reference", f"{q.device.type}: the Triton kernel needs CUDA"
    why_not = fa4_supports(q, layout)
    if why_not is None and min(layout.q_block, layout.k_block) < FA4_BLOCK:
        # measured on an H200 (session 29, VSA 0.875, bf16, 12 heads, D128): FA4's 64x64 tiles ran no faster than the
        # Triton kernel: 8.41 vs 8.42 ms at 18x48x80, 1.92 vs 1.82 ms at 21x30x52
        return "triton", (f"Triton kernel ({layout.q_block}x{layout.k_block} blocks: FA4 runs them too, measured no "
                          f"faster; {ENV}=fa4 to force it)")
    if why_not is None:
        return "fa4", "FA4 block-sparse runs here (fastest on H100)"
    return "triton", f"Triton kernel ({why_not})"


def run_block_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout,
                     scale: float | None = None, route: str | None = None) -> torch.Tensor:
    """Block-sparse attention through `route` (default: `pick_route`)."""
    route = route or pick_route(q, layout)[0]
    if route == "fa4":
        return fa4_block_sparse_attention(q, k, v, layout, scale)
    if route == "triton":
        from sglx.attention.kernels.block_sparse_attention import block_sparse_attention

        return block_sparse_attention(q, k, v, layout, scale)
    return masked_attention(q, k, v, layout, scale)
