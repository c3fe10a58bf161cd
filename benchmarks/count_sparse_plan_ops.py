"""Ops dispatched and host reads per SVG2 / VMoBA call, counted on CPU with torch.profiler (no GPU needed).

On a GPU every host read (.item(), int(), bool(), nonzero, ...) drains the launch queue, and every op is a
launch, so these counts say how much a call waits on the host, not how long it takes (that needs the GPU:
bench_sparse_backends.py). The kernel itself is left out: `run` is replaced by the identity, so what is
counted is planning (pooling / clustering, selection, layout) and the permutations. "ops" are the top-level
aten ops that are not views or allocations; "host reads" are the ops above at any depth. The import path
decides which sglx is counted, so two trees can be compared:

    PYTHONPATH=src python3 benchmarks/count_sparse_plan_ops.py
    PYTHONPATH=/path/to/older/src python3 benchmarks/count_sparse_plan_ops.py
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.svg2 import SparseVideoGen2Backend
from sglx.attention.diffusion.sparse.vmoba import VMoBABackend
from sglx.bench.diffusion_sparse import clustered

NOT_LAUNCHES = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::expand", "aten::permute",
    "aten::transpose", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t",
    "aten::alias", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::unbind", "aten::split",
    "aten::narrow", "aten::flatten", "aten::expand_as", "aten::view_as", "aten::result_type", "aten::unflatten",
    "aten::chunk", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::type_as", "aten::movedim",
    "aten::item", "aten::promote_types",
}
HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero",
              "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::bincount"}


def counted(fn: Callable[[], object]) -> tuple[collections.Counter, collections.Counter]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        if e.name in HOST_READS:
            reads[e.name] += 1
        elif e.cpu_parent is None and e.name not in NOT_LAUNCHES:
            ops[e.name] += 1
    return ops, reads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="6x12x16", help="latent T x H x W")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--verbose", action="store_true", help="ops by name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    grid = tuple(int(v) for v in args.grid.split("x"))
    meta = DiTAttnMetadata(grid=grid, num_heads=args.heads, head_dim=args.head_dim, step_index=40, num_steps=50,
                           num_layers=30)
    gen = torch.Generator().manual_seed(0)
    shape = (1, meta.seq_len, args.heads, args.head_dim)
    q, k = (clustered(shape, gen, 32) for _ in range(2))
    v = torch.randn(shape, generator=gen)
    rows = {}

    svg2 = SparseVideoGen2Backend({})
    svg2.run = lambda q_, k_, v_, layout, scale: q_  # kernel left out
    svg2.forward(q, k, v, meta=meta, layer=5)  # first call: 50 k-means iterations

    def warm() -> None:
        svg2.state.layers[5].step = meta.step_index - 1  # as if the previous step clustered: warm start
        svg2.forward(q, k, v, meta=meta, layer=5)

    warm()
    rows["sparse_video_gen_2_attn default, warm call"] = counted(warm)
    vmoba = VMoBABackend({})
    vmoba.run = lambda q_, k_, v_, layout, scale: q_
    for layer, kind in enumerate(("temporal", "spatial", "st")):
        def call(layer: int = layer) -> None:
            vmoba.forward(q, k, v, meta=meta, layer=layer)

        call()  # caches (tile orders, chunk tables) built
        rows[f"vmoba_attn default, {kind} layer"] = counted(call)
    print(f"grid {grid} ({meta.seq_len} tokens), {args.heads} heads, head dim {args.head_dim}, CPU, kernel left out")
    for name, (ops, reads) in rows.items():
        print(f"{name:45s} ops {sum(ops.values()):4d}  host reads {sum(reads.values()):2d} {dict(reads)}")
        if args.verbose:
            print("    ", dict(ops.most_common()))


if __name__ == "__main__":
    main()
