"""The paired-query-block kernel (kernels/block_sparse_pairs.py) against the one-block kernel on VSA's layouts, same
run: 18x48x80 and 21x30x52, B1 H12 D128 bf16, sparsity 0.875, clustered q/k (bench_sparse_backends.py's inputs), and
the same layouts with every odd query block's list copied from its even neighbour (all picks shared: the most the
pairing can give). Each run is checked against float64 on sampled rows first. Usage:

    PYTHONPATH=src python3 benchmarks/bench_block_sparse_pairs.py --out $OUT/pairs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_backends import clustered  # noqa: E402
from bench_sparse_video import bench, rel_err, sampled_reference  # noqa: E402

from sglx.attention.diffusion.metadata import DiTAttnMetadata  # noqa: E402
from sglx.attention.diffusion.sparse.layout import BlockSparseLayout  # noqa: E402
from sglx.attention.diffusion.sparse.tiled import to_order  # noqa: E402
from sglx.attention.diffusion.sparse.video_sparse import vsa_plan  # noqa: E402
from sglx.attention.kernels.block_sparse_attention import block_sparse_attention  # noqa: E402
from sglx.attention.kernels.block_sparse_pairs import block_sparse_pairs, pair_lists  # noqa: E402

CONFIGS = ((8, 2), (8, 3), (4, 2), (4, 3), (8, 1))  # (num_warps, num_stages)


def shared_copy(layout: BlockSparseLayout) -> BlockSparseLayout:
    idx, cnt = layout.kv_indices.clone(), layout.kv_counts.clone()
    n = idx.shape[2] // 2 * 2
    idx[:, :, 1:n:2], cnt[:, :, 1:n:2] = idx[:, :, 0:n:2], cnt[:, :, 0:n:2]
    return BlockSparseLayout(layout.q_block, layout.k_block, layout.seq_len, idx, cnt, layout.k_lengths)


def run_grid(grid: tuple[int, int, int], device: torch.device) -> list[dict]:
    meta = DiTAttnMetadata(grid=grid, num_heads=12, head_dim=128)
    gen = torch.Generator().manual_seed(0)
    shape = (1, meta.seq_len, 12, 128)
    q, k = (clustered(shape, gen).to(device, torch.bfloat16) for _ in range(2))
    v = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    plan = vsa_plan(q, k, meta, 0.875, 128 ** -0.5)
    qs, ks, vs = (to_order(t, plan.order) for t in (q, k, v))
    scale = 128 ** -0.5
    rows = torch.randperm(meta.seq_len, device=device)[:256].sort().values
    found = []
    for label, layout in (("vsa", plan.layout), ("vsa, odd rows copied (all shared)", shared_copy(plan.layout))):
        want = sampled_reference(qs, ks, vs, layout, rows, scale)
        lists, counts = pair_lists(layout)
        share = (counts[..., 2].float() / counts.sum(-1).clamp(min=1).float()).mean().item()
        base = bench(lambda layout=layout: block_sparse_attention(qs, ks, vs, layout, scale), device)
        row = {"grid": grid, "layout": label, "shared_of_union": round(share, 4), "one_block_ms": base,
               "pair_lists_ms": bench(lambda layout=layout: pair_lists(layout), device), "pairs": {}}
        for warps, stages in CONFIGS:
            try:
                out = block_sparse_pairs(qs, ks, vs, layout, scale, num_warps=warps, num_stages=stages)
                err = rel_err(out[:, rows], want)
                ms = bench(lambda layout=layout, w=warps, s=stages: block_sparse_pairs(
                    qs, ks, vs, layout, scale, num_warps=w, num_stages=s), device) if err <= 2e-2 else None
                row["pairs"][f"{warps}w{stages}s"] = {"ms": ms, "rel_err": err}
            except Exception as exc:  # noqa: BLE001 - a config that fails is a data point
                row["pairs"][f"{warps}w{stages}s"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        found.append(row)
        print(json.dumps(row), flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for grid in ((18, 48, 80), (21, 30, 52)):
        res["rows"] += run_grid(grid, device)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
