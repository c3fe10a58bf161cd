"""Launch sweep of sglx's Triton extend (prefill) kernel against cuDNN in the same run: tiles, warps, stages, and
this step's K/V tiles through TMA descriptors (`ExtendConfig.tma`) or plain loads (issue 13: triton causal prefill
at least 0.85x cuDNN's best call).

Shapes: causal prefill of 4096 new tokens with no prefix, B4, 32 query heads, head dim 128, as MHA (32 KV heads,
the issue's bench shape) and as Llama-3.1-8B's GQA (8 KV heads); and 512 new tokens on a 4096-token cached prefix
(B4, MHA). K/V of the new tokens are strided views of one fused qkv tensor, as the triton backend hands them over,
and are also stored in a pool read through page-1 indices (the prefix and the tiles that straddle it). Each config
is checked against cuDNN's output (bf16 relative error <= 2e-2) before it is timed; `triton.testing.do_bench`
medians. Usage (GPU):

    PYTHONPATH=src python3 benchmarks/sweep_extend_prefill.py --out $OUT/sweep_extend.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention

# (block_m, block_n, warps, stages, tma, warp_specialize); None fields: the kernel's default for the shape.
# Session 12's sweeps (sweep_extend_prefill_h100_s12.json, ..._ws_h100_s12.json): 128x128, 8 warps, 3 stages, TMA
# best (0.82-0.83x cuDNN); warp specialization no faster, 4-warp 128-row tiles and 64-row tiles slower. Session 13
# (sweep_extend_prefill_pipe_h100_s13.json) tried a software-pipelined unmasked loop (the next tile's QK^T issued
# before this tile's softmax, FA3's intra-warpgroup overlap written in Triton): 0.44-0.55x cuDNN against the
# default's 0.824-0.836x in the same run (not investigated further); it was removed.
CONFIGS = [(None, None, None, None, None, False), (128, 128, 8, 2, True, False), (128, 64, 8, 3, True, False),
           (None, None, None, None, None, False)]
# --schedule: program orders on the default launch, alternated (ExtendConfig.section: n (request, head) pairs at a
# time; 0 = one after another). Session 16 made 8 the SM90 default for GQA prefill
# (sweep_extend_sections_h100_s16.json).
# Its first run (sweep_extend_fma_sections_h100_s16.json) also timed half the exponentials on the FMA pipe
# (FlashAttention-4's exp2 emulation): 8-11% slower on every shape, removed.
SCHEDULE = [{"section": 0}, {"section": 4}, {"section": 8}, {"section": 0}, {"section": 4}, {"section": 8},
            {"section": 0}, {"section": 4}]
# --prefetch: the default launch against slot ids a tile ahead forced on, alternated (ExtendConfig.prefetch_slots;
# the default turns it on only where most keys come from the pool: forced on for causal prefill it spilled and was
# 2-5% slower in session 19, before the pool tiles loaded K as rows with int32 offsets, which left no spills)
PREFETCH = [{}, {"prefetch_slots": True}, {}, {"prefetch_slots": True}]
SHAPES = [  # (name, batch, prefix, new, q heads, kv heads, configs: all or the first n)
    ("causal_4096_mha", 4, 0, 4096, 32, 32, None),
    ("causal_4096_gqa8", 4, 0, 4096, 32, 8, None),
    ("prefix_4096_new_512_mha", 4, 4096, 512, 32, 32, None),
]
SCHEDULE_SHAPES = [  # GQA, where sections were faster in session 16's first run, at Llama-3.1-8B's heads
    ("causal_4096_gqa8", 4, 0, 4096, 32, 8, None),
    ("causal_8192_gqa8_b1", 1, 0, 8192, 32, 8, None),
    ("causal_2048_gqa8_b2", 2, 0, 2048, 32, 8, None),
    ("causal_4096_mha", 4, 0, 4096, 32, 32, 6),
    ("prefix_4096_new_512_gqa8", 4, 4096, 512, 32, 8, 6),
]


def make_case(batch: int, prefix: int, new: int, hq: int, hkv: int, d: int = 128, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    t = batch * new
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device, dtype=dt, generator=gen)
    q = qkv[:, :hq * d].view(t, hq, d)
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    total = prefix + new
    k_pre = torch.randn(batch, prefix, hkv, d, device=device, dtype=dt, generator=gen)
    v_pre = torch.randn(batch, prefix, hkv, d, device=device, dtype=dt, generator=gen)
    keys = torch.cat([k_pre, k_new.view(batch, new, hkv, d)], 1)  # [B, L, Hkv, D]
    values = torch.cat([v_pre, v_new.view(batch, new, hkv, d)], 1)
    pool_k = torch.zeros(1 + batch * total, hkv, d, device=device, dtype=dt)  # slot 0: the padding slot
    pool_v = torch.zeros_like(pool_k)
    pool_k[1:] = keys.reshape(-1, hkv, d)
    pool_v[1:] = values.reshape(-1, hkv, d)
    kv_indices = torch.arange(1, 1 + batch * total, device=device, dtype=torch.int32)
    kv_indptr = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * total
    qo_indptr = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * new
    return dict(q=q, k_new=k_new, v_new=v_new, keys=keys, values=values, pool_k=pool_k, pool_v=pool_v,
                kv_indices=kv_indices, kv_indptr=kv_indptr, qo_indptr=qo_indptr, batch=batch, prefix=prefix,
                new=new, hq=hq, hkv=hkv, d=d)


def cudnn_call(c):
    """cuDNN SDPA's best call on contiguous [B, H, S, D] tensors (GQA: K/V repeated, not timed)."""
    b, n, hq, hkv, d, p = c["batch"], c["new"], c["hq"], c["hkv"], c["d"], c["prefix"]
    q = c["q"].reshape(b, n, hq, d).transpose(1, 2).contiguous()
    k = c["keys"].transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous()
    v = c["values"].transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous()
    if p == 0:
        def fn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)

        def fn():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return fn, lambda o: o.transpose(1, 2).reshape(b * n, hq, d)


def flops(c) -> float:
    b, n, p, hq, d = c["batch"], c["new"], c["prefix"], c["hq"], c["d"]
    pairs = n * p + n * (n + 1) / 2  # causal (query, key) pairs per head
    return 4.0 * b * hq * pairs * d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--schedule", action="store_true",
                    help="time SCHEDULE (head sections) on SCHEDULE_SHAPES instead of CONFIGS on SHAPES")
    ap.add_argument("--prefetch", action="store_true",
                    help="time PREFETCH (slot ids a tile ahead forced on) on SHAPES instead of CONFIGS")
    ap.add_argument("--defaults", action="store_true",
                    help="time only the default launch, on every shape of SHAPES and SCHEDULE_SHAPES (A/B of two trees "
                         "through PYTHONPATH, alternated by the caller)")
    args = ap.parse_args()
    from triton.testing import do_bench

    t0 = time.time()
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "shapes": []}
    import triton
    results["triton"] = triton.__version__
    shapes = SCHEDULE_SHAPES if args.schedule else SHAPES
    if args.defaults:
        shapes = list({s[0]: s[:6] + (1,) for s in SHAPES + SCHEDULE_SHAPES}.values())  # CONFIGS[0]: the default
    for name, b, p, n, hq, hkv, first in shapes:
        c = make_case(b, p, n, hq, hkv)
        fn, rows = cudnn_call(c)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ref = rows(fn()).float()
            cudnn_ms = do_bench(fn, warmup=100, rep=500, return_mode="median")
        tf = flops(c)
        entry = {"shape": name, "batch": b, "prefix": p, "new": n, "q_heads": hq, "kv_heads": hkv, "head_dim": 128,
                 "cudnn_ms": cudnn_ms, "cudnn_tflops": tf / cudnn_ms / 1e9, "configs": []}
        print(f"{name}: cuDNN {cudnn_ms:.4f} ms {tf / cudnn_ms / 1e9:.0f} TFLOP/s", flush=True)
        for cfg in (SCHEDULE if args.schedule else PREFETCH if args.prefetch else CONFIGS)[:first]:
            if time.time() - t0 > args.budget_s:
                entry["configs"].append({"config": cfg, "skipped": "budget"})
                continue
            if isinstance(cfg, dict):
                config = ExtendConfig(**cfg)
            else:
                bm, bn, w, s, tma, ws = cfg
                config = ExtendConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, tma=tma, warp_specialize=ws)
            out = torch.empty(b * n, hq, 128, device="cuda", dtype=torch.bfloat16)

            def call(config=config, out=out, c=c, n=n, cached=b * p):
                return extend_attention(c["q"], c["pool_k"], c["pool_v"], out, c["qo_indptr"], c["kv_indptr"],
                                        c["kv_indices"], n, 128 ** -0.5, config=config, k_ext=c["k_new"],
                                        v_ext=c["v_new"], prefix_tokens=cached)
            row = {"config": cfg}
            try:
                got = call().float()
                err = ((got - ref).norm() / ref.norm()).item()
                row["rel_err_vs_cudnn"] = err
                if not err <= 2e-2:
                    row["error"] = "wrong output"
                else:
                    ms = do_bench(call, warmup=100, rep=500, return_mode="median")
                    row.update(ms=ms, tflops=tf / ms / 1e9, x_cudnn=cudnn_ms / ms)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a sweep result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            entry["configs"].append(row)
            print(f"  {cfg}: " + (f"{row['ms']:.4f} ms {row['tflops']:.0f} TFLOP/s {row['x_cudnn']:.3f}x cuDNN "
                                  f"(err {row['rel_err_vs_cudnn']:.1e})" if "ms" in row else row.get("error", "")),
                  flush=True)
        results["shapes"].append(entry)
        c.clear()
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
