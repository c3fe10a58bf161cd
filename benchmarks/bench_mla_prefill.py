"""MLA prefill / extend attention of one layer, backend against backend in one process (CUDA events, medians).

Each call is what the engine runs per layer in an extend step: the backend's metadata once, then `forward_mla`
(latents of prefix + new tokens read from the pool and expanded per head, the attention, W_UV where absorbed).
DeepSeek-V2-Lite's attention (16 heads) and DeepSeek-V3's (128 heads), nope 128 + rope 64, v 128, latent
512 + 64, bf16, page size 1 on shuffled slots. Backends: triton (sglx's extend kernel), fa4 (FA4's varlen kernel
on the same expansion), flashinfer (its absorbed MLA wrapper) where installed.

python benchmarks/bench_mla_prefill.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sglx.attention.llm.base import BackendContext
from sglx.attention.llm.mla_base import MLALayerSpec, MLAProjections
from sglx.attention.registry import availability, find
from sglx.attention.request import AttentionRequest
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool
from sglx.llm.mla_kv_cache import MLATokenKVPool
from sglx.platform import current

DN, DR, DV, R = 128, 64, 128, 512
SHAPES = [  # (name, heads, new tokens per request, cached prefix per request, requests)
    ("v2-lite 1x512", 16, 512, 0, 1), ("v2-lite 4x4096", 16, 4096, 0, 4), ("v2-lite 4k prefix + 512", 16, 512, 4096, 1),
    ("v2-lite 64x512", 16, 512, 0, 64), ("v3 1x512", 128, 512, 0, 1), ("v3 4k prefix + 512", 128, 512, 4096, 1),
]


def make_step(heads: int, new: int, prefix: int, bs: int, dev: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    total = prefix + new
    gen = torch.Generator().manual_seed(0)
    r2t = ReqToTokenPool(bs + 1, total + 1, dev)
    pool = MLATokenKVPool(bs * total + 8, 1, 1, R, DR, dtype, "auto", dev)
    slots = (torch.randperm(bs * total, generator=gen) + 1).to(dev)
    rows = []
    for i in range(bs):
        row = r2t.alloc()
        r2t.req_to_token[row, :total] = slots[i * total:(i + 1) * total].int()
        rows.append(row)
    lat = torch.randn(bs * total, R + DR, generator=gen).to(dev, dtype)
    pool.set_latent(0, slots, lat[:, :R], lat[:, R:])
    spec = MLALayerSpec(0, heads, DN, DR, DV, R, (DN + DR) ** -0.5)
    proj = MLAProjections.from_kv_b_proj((torch.randn(heads * (DN + DV), R, generator=gen) * R ** -0.5).to(dev, dtype),
                                         spec)
    q_nope = torch.randn(bs * new, heads, DN, generator=gen).to(dev, dtype)
    q_pe = torch.randn(bs * new, heads, DR, generator=gen).to(dev, dtype)
    batch = dict(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(bs * new, dtype=torch.long, device=dev),
        positions=torch.arange(prefix, total, device=dev).repeat(bs), req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.full((bs,), total, device=dev),
        out_cache_loc=torch.cat([r2t.req_to_token[w, prefix:total].long() for w in rows]), req_to_token_pool=r2t,
        token_kv_pool=pool, seq_lens_cpu=[total] * bs, extend_seq_lens_cpu=[new] * bs,
        extend_prefix_lens_cpu=[prefix] * bs)
    return r2t, pool, spec, proj, q_nope, q_pe, batch


def time_backend(name: str, step, dev: str, dtype: torch.dtype, reps: int,  # type: ignore[no-untyped-def]
                 return_out: bool = False):
    """Median ms of one layer's extend on backend `name` (and its output with return_out)."""
    r2t, pool, spec, proj, q_nope, q_pe, fields = step
    ctx = BackendContext(torch.device(dev), dtype, spec.num_heads, 1, R + DR, 1, r2t, pool)
    backend = find(name, "llm", "mla").load()(ctx)
    override = getattr(type(backend), "extend_config_override", None)  # set by sweep_mla_extend.py
    if override is not None:
        backend.extend_config = override
    batch = ForwardBatch(attn_backend=backend, **fields)
    out = []

    def run() -> None:
        backend.init_forward_metadata(batch)
        out[:] = [backend.forward_mla(q_nope, q_pe, None, None, spec, proj, batch, save_kv_cache=False)]

    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return (statistics.median(times), out[0]) if return_out else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--backends", default="triton,fa4,flashinfer")
    args = parser.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    snap = current()
    names = []
    for name in args.backends.split(","):
        verdict = availability(find(name, "llm", "mla"), snap, AttentionRequest(kind="mla", phase="prefill"))
        if verdict.ok:
            names.append(name)
        else:
            print(f"skip {name}: {'; '.join(verdict.reasons)}")
    rows = []
    for shape, heads, new, prefix, bs in SHAPES:
        step = make_step(heads, new, prefix, bs, dev, dtype)
        # causal attention FLOPs of the expanded form: QK^T (dn + dr) and PV (dv) over the visible keys
        visible = bs * (new * prefix + new * (new + 1) // 2)
        flops = 2 * heads * visible * (DN + DR + DV)
        row = {"shape": shape, "heads": heads, "new": new, "prefix": prefix, "requests": bs, "ms": {}}
        for name in names:
            ms = time_backend(name, step, dev, dtype, args.reps)
            row["ms"][name] = ms
        best = min(row["ms"].values())
        print(f"{shape:28s} " + "  ".join(f"{n} {ms:8.3f} ms ({flops / ms / 1e9:6.1f} TFLOP/s, {ms / best:.2f}x)"
                                           for n, ms in row["ms"].items()))
        rows.append(row)
        del step
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
