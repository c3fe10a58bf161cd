"""Diagnostic (session 22): the Gluon MLA kernel on e4m3 latents of several sizes, bit-moved (FMT 3) and cast routes,
relative error against float64 on the stored values.

Usage (GPU): PYTHONPATH=src python3 benchmarks/diag_mla_e4m3_small.py
"""

from __future__ import annotations

import torch

import sglx.attention.kernels.mla_decode as md
from sglx.attention.kernels.common import num_sms
from sglx.llm.mla_kv_cache import MLATokenKVPool

DEV = "cuda"


def run(size_log2: int, q_scale: float, batch: int, bits: bool) -> str:
    r, dr, heads, ctx = 512, 64, 128, 900
    gen = torch.Generator().manual_seed(3)
    pool = MLATokenKVPool(batch * ctx + 2, 1, 1, r, dr, torch.bfloat16, "fp8_e4m3", DEV)
    slots = (torch.randperm(batch * ctx, generator=gen) + 1).to(DEV)
    lat = (torch.randn(batch * ctx, r + dr, generator=gen) * 2.0 ** size_log2).to(DEV, torch.bfloat16)
    pool.set_latent(0, slots, lat[:, :r], lat[:, r:])
    codes = pool.kv_buffer[0][slots, 0]
    sub = ((codes & 0x78) == 0).float().mean().item()
    q = (torch.randn(batch, heads, r + dr, generator=gen) * q_scale).to(DEV, torch.bfloat16)
    config = md.resolve_config(md.MLADecodeConfig(), heads, True, torch.device(DEV))
    splits = md.mla_num_splits(batch, heads, ctx, num_sms(torch.device(DEV)), config)
    out = torch.empty(batch, heads, r, dtype=torch.bfloat16, device=DEV)
    mid_o = torch.empty(batch, heads, splits, r, device=DEV)
    saved = md.bits_k_applies
    if not bits:
        md.bits_k_applies = lambda fmt, dtype: False
    try:
        md.mla_decode_attention(q, pool.kv_buffer[0], out, torch.arange(batch + 1, device=DEV, dtype=torch.int32) * ctx,
                                slots.int(), mid_o, mid_o[..., 0].clone(), (128 + 64) ** -0.5, r,
                                kv_scale=pool.kv_scale[0], fp8_dtype=pool.fp8_dtype, config=config)
    finally:
        md.bits_k_applies = saved
    stored = pool.get_latent(0, slots.long(), torch.float64).view(batch, ctx, r + dr)
    probs = torch.softmax(torch.einsum("bhd,bld->bhl", q.double(), stored) * (128 + 64) ** -0.5, -1)
    ref = probs @ stored[..., :r]
    err = ((out.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    return (f"size 2**{size_log2} q*{q_scale} batch {batch} bits {bits}: subnormal codes {sub:.2f} "
            f"probs max {probs.max().item():.3f} rel err {err:.3e} nan {out.isnan().any().item()} "
            f"out amax {out.abs().max().item():.3e} ref amax {ref.abs().max().item():.3e}")


if __name__ == "__main__":
    for size, qs in ((-7, 200.0), (-7, 30.0), (-4, 30.0), (0, 1.0)):
        for batch in (4, 64):
            for bits in (True, False):
                print(run(size, qs, batch, bits), flush=True)
