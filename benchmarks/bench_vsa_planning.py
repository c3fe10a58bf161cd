"""VSA's planning pieces on the GPU, one at a time: pooling (the block-means kernel over launch shapes, and torch's
reduction for comparison) and the top-k pick (torch.topk + sort against the ascending top-k kernel), at 18x48x80
(1,080 cube blocks) and 21x30x52, B1 H12 D128 bf16. Usage:

    PYTHONPATH=src python3 benchmarks/bench_vsa_planning.py --out $OUT/vsa_planning.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing as tt

from sglx.attention.diffusion.metadata import DiTAttnMetadata
from sglx.attention.diffusion.sparse.tiled import real_lengths, to_order
from sglx.attention.diffusion.sparse.video_sparse import compute_topk, cube_order
from sglx.attention.kernels.block_means import block_means_kernel
from sglx.attention.kernels.topk_rows import topk_ascending


def ms(fn) -> float:
    return round(tt.do_bench(fn, warmup=25, rep=200), 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for grid in ((18, 48, 80), (21, 30, 52)):
        meta = DiTAttnMetadata(grid=grid, num_heads=12, head_dim=128)
        order = cube_order(meta)
        x = to_order(torch.randn(1, meta.seq_len, 12, 128, device="cuda", dtype=torch.bfloat16), order)
        lengths = real_lengths(order).cuda()
        want = block_means_kernel(x, lengths, 64)
        for block_c, warps in ((64, 1), (64, 2), (64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8),
                               (512, 4), (512, 8), (1024, 8)):
            got = block_means_kernel(x, lengths, 64, block_c, warps)
            assert torch.allclose(got, want, atol=1e-5)
            rows.append({"grid": grid, "op": "block_means kernel", "block_c": block_c, "num_warps": warps,
                         "ms": ms(lambda: block_means_kernel(x, lengths, 64, block_c, warps))})  # noqa: B023
            print(rows[-1], flush=True)
        nb = order.num_blocks
        full = nb * 64
        if full <= x.shape[1]:
            rows.append({"grid": grid, "op": "torch view-sum (full blocks only)",
                         "ms": ms(lambda: x[:, :full].reshape(1, nb, 64, -1).sum(2, dtype=torch.float32))})  # noqa: B023
            print(rows[-1], flush=True)
        scores = torch.randn(1, 12, nb, nb, device="cuda")
        k = compute_topk(0.875, nb)
        allowed = torch.ones(nb, dtype=torch.bool, device="cuda")
        ref = scores.topk(k, dim=-1, sorted=False).indices.to(torch.int32).sort(-1).values
        assert torch.equal(topk_ascending(scores, k, allowed), ref)
        rows.append({"grid": grid, "op": "torch topk + int32 sort", "k": k,
                     "ms": ms(lambda: scores.topk(k, dim=-1, sorted=False).indices.to(torch.int32).sort(-1))})  # noqa: B023
        print(rows[-1], flush=True)
        for warps in (1, 2, 4, 8):
            assert torch.equal(topk_ascending(scores, k, allowed, warps), ref)
            rows.append({"grid": grid, "op": "topk_ascending kernel", "k": k, "num_warps": warps,
                         "ms": ms(lambda: topk_ascending(scores, k, allowed, warps))})  # noqa: B023
            print(rows[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
