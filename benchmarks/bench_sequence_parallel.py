"""Sequence-parallel DiT timings: SP 1 vs SP N on one host, attention alone and one full DiT forward.

Wan2.1-14B shapes by default (720p 81 frames: 75,600 latent tokens, 40 heads of 128; CFG batch of 2 for the
step). Every rank builds the same inputs; SP 1 runs on rank 0 alone (the other ranks wait), then every split
(`--splits u2r1,u1r2`) runs on all ranks: q/k/v sharded by sequence, SequenceParallelBackend around the selected
backend, each call timed with CUDA events between barriers, median of `--iters`. The SP output is gathered and
compared with SP 1's (max relative error). `--step` also times one denoising forward of a dummy-weight
WanTransformer3DModel (the 14B config) with sglx's processors, SP 1 vs SP N. NOT yet run on a multi-GPU
machine. Usage (lent nvidia-h200-x2):

    PYTHONPATH=src python3 benchmarks/bench_sequence_parallel.py --world 2 --step --out $OUT/sp.json
    PYTHONPATH=src python3 benchmarks/bench_sequence_parallel.py --tiny --device cpu   # logic check (gloo)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
               freq_dim=256, ffn_dim=13824, num_layers=40, patch_size=(1, 2, 2), cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
TINY_WAN = dict(WAN_14B, num_attention_heads=4, attention_head_dim=16, text_dim=32, freq_dim=16, ffn_dim=64,
                num_layers=2, in_channels=4, out_channels=4)


def _sync(device: torch.device, barrier: bool = True) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier and dist.is_initialized():
        dist.barrier()


def _time(fn: Any, device: torch.device, iters: int, warmup: int = 2, together: bool = True) -> float:
    """Median seconds of fn() over iters; `together`: every rank calls it and starts each call at a barrier
    (False for SP 1, which rank 0 runs alone)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device, together)
        start = time.perf_counter()
        fn()
        _sync(device, together)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _backend(name: str) -> Any:
    from sglx.attention.registry import find

    spec = find(name, "diffusion", "dit")
    assert spec is not None, name
    return spec.load()({})


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from sglx.attention.diffusion.metadata import DiTAttnMetadata
    from sglx.diffusion.parallel.attention import SequenceParallelBackend
    from sglx.diffusion.parallel.collectives import gather_seq
    from sglx.diffusion.parallel.degrees import SPDegrees
    from sglx.diffusion.parallel.groups import sp_groups
    from sglx.distributed.group import destroy_distributed, init_distributed

    ctx = init_distributed(device=args.device if args.device == "cpu" else None)
    dev, dtype = ctx.device, getattr(torch, args.dtype)
    try:
        grid = tuple(args.grid)
        tokens = grid[0] * grid[1] * grid[2]
        meta = DiTAttnMetadata(grid=grid, num_heads=args.heads, head_dim=args.head_dim)
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, tokens, args.heads, args.head_dim, generator=gen).to(dev, dtype) for _ in range(3))
        backend = _backend(args.backend)
        out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "world": world, "tokens": tokens, "heads": args.heads,
                               "head_dim": args.head_dim, "dtype": args.dtype, "backend": args.backend, "attention": {}}
        ref = None
        if rank == 0:
            ref = backend.forward(q, k, v, meta=meta)
            out["attention"]["sp1_s"] = _time(lambda: backend.forward(q, k, v, meta=meta), dev, args.iters, 1,
                                               together=False)
        _sync(dev)
        for split in args.splits.split(","):
            u, r = int(split[1:split.index("r")]), int(split[split.index("r") + 1:])
            if u * r != world or args.heads % u:
                continue
            sp = SequenceParallelBackend(backend, sp_groups(SPDegrees(u, r)))
            local = [t.chunk(world, dim=1)[rank].contiguous() for t in (q, k, v)]
            got = gather_seq(sp.forward(*local, meta=meta))
            seconds = _time(lambda sp=sp, local=local: sp.forward(*local, meta=meta), dev, args.iters)
            row: dict[str, Any] = {"seconds": seconds}
            if ref is not None:
                row["max_rel_err"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                row["ratio_vs_sp1"] = seconds / out["attention"]["sp1_s"]
            out["attention"][split] = row
        if args.step:
            out["step"] = _step(rank, world, args, dev, dtype)
        return out
    finally:
        destroy_distributed()


def _step(rank: int, world: int, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One DiT forward (CFG batch of 2) of a dummy-weight Wan transformer with sglx's processors: SP 1 vs SP N."""
    from diffusers import WanTransformer3DModel

    from sglx.attention.diffusion.metadata import DiTAttnMetadata, dit_step
    from sglx.diffusion.parallel.attention import SequenceParallelBackend
    from sglx.diffusion.parallel.degrees import SPDegrees
    from sglx.diffusion.parallel.groups import sp_groups
    from sglx.diffusion.parallel.sharding import shard_wan
    from sglx.diffusion.processors import wan as wan_processors

    cfg = TINY_WAN if args.tiny else WAN_14B
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # 14B parameters built in bf16 directly (fp32 first would need 56 GB more)
    try:
        with torch.device(dev):
            model = WanTransformer3DModel(**cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)
    t, h, w = args.grid
    latents = torch.randn(2, cfg["in_channels"], t, h * 2, w * 2, device=dev, dtype=dtype)
    text = torch.randn(2, args.text_tokens, cfg["text_dim"], device=dev, dtype=dtype)
    timestep = torch.full((2,), 500.0, device=dev)
    meta = DiTAttnMetadata(grid=(t, h, w), num_heads=cfg["num_attention_heads"],
                           head_dim=cfg["attention_head_dim"], batch_size=2, cfg=True, num_layers=cfg["num_layers"])
    backend = _backend(args.backend)

    def forward() -> torch.Tensor:
        with dit_step(meta), torch.no_grad():
            return model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]

    res: dict[str, Any] = {"layers": cfg["num_layers"], "text_tokens": args.text_tokens}
    wan_processors.install(model, backend)
    if rank == 0:
        ref = forward()
        res["sp1_s"] = _time(forward, dev, args.step_iters, 0, together=False)  # ref above was the warm-up
    _sync(dev)
    u = world if cfg["num_attention_heads"] % world == 0 else 1
    wan_processors.install(model, SequenceParallelBackend(backend, sp_groups(SPDegrees(u, world // u))))
    handles = shard_wan(model, rank, world)
    got = forward()  # also the warm-up
    res[f"u{u}r{world // u}_s"] = _time(forward, dev, args.step_iters, 0)
    for handle in handles:
        handle.remove()
    if rank == 0:
        res["max_rel_err"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        res["ratio_vs_sp1"] = res[f"u{u}r{world // u}_s"] / res["sp1_s"]
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--grid", type=int, nargs=3, default=(21, 45, 80), help="latent tokens (T, H, W)")
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="torch_sdpa")
    parser.add_argument("--splits", default="u2r1,u1r2")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--step-iters", type=int, default=1, help="timed DiT forwards (a 14B one takes tens of s)")
    parser.add_argument("--step", action="store_true", help="also one dummy-weight Wan DiT forward")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a logic check)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.tiny:
        args.grid, args.heads, args.head_dim, args.dtype, args.iters, args.text_tokens = (2, 4, 4), 4, 16, \
            "float32", 2, 8
    from sglx.distributed.spawn import spawn_workers

    result = spawn_workers(_rank, args.world, (args,), timeout_s=3600)[0]
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
