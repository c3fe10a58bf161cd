"""Time sglx's Triton decode and extend kernels against SDPA (cuDNN) on contiguous KV of the same shape.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_triton_decode.py --output results.json [--sweep]
Decode: B=64, 32 query / 8 KV heads, head dim 128, context 4096, page size 1 and 16 (pages shuffled:
no locality helps), bf16 KV and fp8 (e4m3) KV. Prefill: causal, B=4, 32 heads, head dim 128, 4096
new tokens and no prefix (vs cuDNN), plus 512 new tokens on a 4096-token cached prefix (ours only).
Every timed kernel is first checked against SDPA; times are medians of triton.testing.do_bench
(warm-up, L2 flushed between runs). --sweep also times other launch configs and split counts.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from sglx.attention.kernels.common import num_sms
from sglx.attention.kernels.decode_attention import (
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
    semaphore_count,
)
from sglx.attention.kernels.extend_attention import ExtendConfig, extend_attention
from sglx.attention.kernels.kv_indices import build_kv_indices, build_kv_indptr
from sglx.attention.kernels.store_kv import store_kv

DEV = torch.device("cuda")
HQ, HKV, DIM = 32, 8, 128
DTYPE = torch.bfloat16


def median_ms(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=50, rep=300, return_mode="median"))


def paged_indices(bs: int, ctx: int, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """kv_indptr, kv_indices (built by our kernel from a req_to_token over shuffled pages) and slots needed."""
    gen = torch.Generator().manual_seed(seed)
    per_req = -(-ctx // page)
    order = torch.randperm(bs * per_req, generator=gen) + 1  # page 0 is padding
    slots = (order.view(bs, per_req, 1) * page + torch.arange(page)).view(bs, -1)[:, :ctx]
    r2t = torch.zeros(bs + 1, ctx, dtype=torch.int32)
    r2t[1:] = slots.int()
    r2t = r2t.to(DEV)
    kv_indptr = build_kv_indptr(torch.full((bs,), ctx, dtype=torch.int32, device=DEV))
    kv_indices = torch.empty(bs * ctx, dtype=torch.int32, device=DEV)
    build_kv_indices(r2t, torch.arange(1, bs + 1, device=DEV), kv_indptr, kv_indices)
    return kv_indptr, kv_indices, (bs * per_req + 1) * page


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GQA decode on contiguous KV [B, Hkv, S, D]: a KV head's query group are its query rows (no KV copies)."""
    bs, hq, dim = q.shape
    hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(bs, hkv, hq // hkv, dim), k, v, scale=dim ** -0.5).reshape(bs, hq, dim)


def decode_variant(name: str, page: int, fp8: torch.dtype | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   ref: torch.Tensor, cudnn_ms: float, sweep: bool) -> dict:
    bs, _, ctx, _ = k.shape
    kv_indptr, kv_indices, slots = paged_indices(bs, ctx, page, seed=page)
    store = torch.uint8 if fp8 is not None else DTYPE
    k_buf = torch.zeros(slots + page, HKV, DIM, device=DEV, dtype=store)
    v_buf = torch.zeros_like(k_buf)
    loc = kv_indices.long()
    store_kv(k.transpose(1, 2).reshape(-1, HKV, DIM), v.transpose(1, 2).reshape(-1, HKV, DIM), k_buf, v_buf, loc,
             fp8_dtype=fp8)
    if fp8 is not None:  # the reference sees what the cache holds
        def dequant(buf: torch.Tensor) -> torch.Tensor:
            return buf[loc].view(fp8).to(DTYPE).view(bs, ctx, HKV, DIM).transpose(1, 2).contiguous()

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = sdpa_decode(q, dequant(k_buf), dequant(v_buf))
    kv_bytes = 2 * bs * HKV * ctx * DIM * (1 if fp8 is not None else 2)
    auto = choose_num_kv_splits(bs, HKV, ctx, num_sms(DEV))
    configs = [DecodeConfig()]
    if sweep:  # (block_n, num_warps, num_stages) around the default (64, 4, 3)
        if fp8 is None:
            others = ((64, 4, 4), (128, 4, 3), (32, 4, 3), (64, 8, 3))
            configs += [DecodeConfig(block_n=bn, num_warps=nw, num_stages=st) for bn, nw, st in others]
        else:  # how fp8 is converted (see DecodeConfig.fp8_convert) x tile shapes
            others = ((64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 8, 3), (32, 4, 3))
            configs += [DecodeConfig(block_n=bn, num_warps=nw, num_stages=st, fp8_convert=cvt)
                        for cvt in ("cast", "ptx_v", "ptx_kv") for bn, nw, st in others]
    splits_list = [auto] + ([s for s in (1, 4) if s != auto] if sweep and fp8 is None else [])
    rows = []
    for cfg in configs:
        for splits in splits_list:
            out = torch.empty(bs, HQ, DIM, device=DEV, dtype=DTYPE)
            mid_o = torch.empty(bs, HQ, splits, DIM, device=DEV)
            mid_lse = torch.empty(bs, HQ, splits, device=DEV)

            sems = torch.zeros(semaphore_count(bs, HQ, HKV), dtype=torch.int32, device=DEV)

            def run(cfg=cfg, out=out, mid_o=mid_o, mid_lse=mid_lse, sems=sems) -> None:
                decode_attention(q, k_buf, v_buf, out, kv_indptr, kv_indices, mid_o, mid_lse, DIM ** -0.5,
                                 fp8_dtype=fp8, config=cfg, semaphores=sems)
            row: dict = dict(config=cfg.__dict__, splits=splits, default=cfg == DecodeConfig() and splits == auto)
            try:
                run()
                row["max_abs_err_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
                row["ms"] = median_ms(run)
                row["tb_per_s"] = kv_bytes / row["ms"] / 1e9
                row["ratio_to_cudnn_bf16"] = row["ms"] / cudnn_ms
                print(f"decode {name} {cfg} splits={splits}: {row['ms']:.4f} ms {row['tb_per_s']:.2f} TB/s "
                      f"err={row['max_abs_err_vs_sdpa']:.2e}", flush=True)
            except Exception as exc:  # a config that fails on this GPU is recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"decode {name} {cfg} splits={splits}: {row['error']}", flush=True)
            rows.append(row)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=DEV)
    r2t_rows = torch.arange(1, bs + 1, device=DEV)
    r2t = torch.zeros(bs + 1, ctx, dtype=torch.int32, device=DEV)
    scratch = torch.empty_like(kv_indices)
    meta_ms = median_ms(lambda: build_kv_indices(r2t, r2t_rows, build_kv_indptr(seq_lens), scratch))
    timed = [r for r in rows if "ms" in r]
    return dict(page_size=page, kv_dtype="fp8_e4m3" if fp8 is not None else "bfloat16", kv_bytes=kv_bytes,
                auto_splits=auto, default=next(r for r in rows if r["default"]),
                best=min(timed, key=lambda r: r["ms"]) if timed else None, sweep=rows, kv_indices_build_ms=meta_ms)


def bench_decode(bs: int, ctx: int, sweep: bool, results: dict) -> None:
    k = torch.randn(bs, HKV, ctx, DIM, device=DEV, dtype=DTYPE)
    v = torch.randn(bs, HKV, ctx, DIM, device=DEV, dtype=DTYPE)
    q = torch.randn(bs, HQ, DIM, device=DEV, dtype=DTYPE)
    kv_bytes = 2 * bs * HKV * ctx * DIM * 2
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = sdpa_decode(q, k, v)
        cudnn_ms = median_ms(lambda: sdpa_decode(q, k, v))
    results["decode_shape"] = dict(batch=bs, q_heads=HQ, kv_heads=HKV, head_dim=DIM, context=ctx, dtype="bfloat16")
    results["decode_sdpa_cudnn_contiguous"] = dict(ms=cudnn_ms, tb_per_s=kv_bytes / cudnn_ms / 1e9)
    print(f"decode sdpa cudnn contiguous: {cudnn_ms:.4f} ms {kv_bytes / cudnn_ms / 1e9:.2f} TB/s", flush=True)
    for name, page, fp8 in (("page1", 1, None), ("page16", 16, None), ("page1_fp8_e4m3", 1, torch.float8_e4m3fn),
                            ("page16_fp8_e4m3", 16, torch.float8_e4m3fn)):
        results[f"decode_triton_{name}"] = decode_variant(name, page, fp8, q, k, v, ref, cudnn_ms, sweep)
        torch.cuda.empty_cache()
    for page in (1, 16):
        fp8_ms = results[f"decode_triton_page{page}_fp8_e4m3"]["default"].get("ms")
        bf16_ms = results[f"decode_triton_page{page}"]["default"].get("ms")
        if fp8_ms and bf16_ms:
            results[f"decode_fp8_over_bf16_page{page}"] = fp8_ms / bf16_ms


def causal_flops(bs: int, heads: int, dim: int, prefix: int, new: int) -> float:
    return 4.0 * bs * heads * dim * (new * prefix + new * (new + 1) / 2)


def prefill_case(prefix: int, new: int, sweep: bool) -> dict:
    bs, heads = 4, 32
    ctx = prefix + new
    kv_indptr, kv_indices, slots = paged_indices(bs, ctx, 16, seed=prefix)
    qo_indptr = build_kv_indptr(torch.full((bs,), new, dtype=torch.int32, device=DEV))
    k = torch.randn(bs, heads, ctx, DIM, device=DEV, dtype=DTYPE)
    v = torch.randn(bs, heads, ctx, DIM, device=DEV, dtype=DTYPE)
    q = torch.randn(bs, heads, new, DIM, device=DEV, dtype=DTYPE)
    k_buf = torch.zeros(slots + 16, heads, DIM, device=DEV, dtype=DTYPE)
    v_buf = torch.zeros_like(k_buf)
    k_tok, v_tok = k.transpose(1, 2).reshape(bs, ctx, heads, DIM), v.transpose(1, 2).reshape(bs, ctx, heads, DIM)
    loc = kv_indices.view(bs, ctx)
    store_kv(k_tok[:, :prefix].reshape(-1, heads, DIM), v_tok[:, :prefix].reshape(-1, heads, DIM), k_buf, v_buf,
             loc[:, :prefix].reshape(-1).long())
    k_new = k_tok[:, prefix:].reshape(-1, heads, DIM)
    v_new = v_tok[:, prefix:].reshape(-1, heads, DIM)
    new_loc = loc[:, prefix:].reshape(-1).long()
    store_kv(k_new, v_new, k_buf, v_buf, new_loc)
    store_ms = median_ms(lambda: store_kv(k_new, v_new, k_buf, v_buf, new_loc))
    q_tok = q.transpose(1, 2).reshape(bs * new, heads, DIM).contiguous()
    flops = causal_flops(bs, heads, DIM, prefix, new)
    entry: dict = dict(shape=dict(batch=bs, heads=heads, head_dim=DIM, prefix=prefix, new=new, causal=True,
                                  page_size=16, dtype="bfloat16"), flops=flops, store_kv_ms=store_ms)
    cudnn_ms = None
    if prefix == 0:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            cudnn_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        entry["sdpa_cudnn"] = dict(ms=cudnn_ms, tflops=flops / cudnn_ms / 1e9)
        print(f"prefill sdpa cudnn: {cudnn_ms:.3f} ms {flops / cudnn_ms / 1e9:.1f} TFLOP/s", flush=True)
    else:  # causal aligned bottom-right: new query i sits at position prefix + i
        mask = torch.ones(new, ctx, dtype=torch.bool, device=DEV).tril(prefix)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_tok = ref.transpose(1, 2).reshape(bs * new, heads, DIM)
    configs = [(ExtendConfig(), True), (ExtendConfig(), False)]
    if sweep:  # (block_m, block_n, warps, stages) x new tokens read from their contiguous rows or the pool
        configs += [(ExtendConfig(*c), ext) for c in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3),
                                                      (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 4))
                    for ext in (True, False)]
    rows = []
    for cfg, ext in configs:
        out = torch.empty_like(q_tok)

        def run(cfg=cfg, out=out, ext=ext) -> None:
            extend_attention(q_tok, k_buf, v_buf, out, qo_indptr, kv_indptr, kv_indices, new, DIM ** -0.5, config=cfg,
                             k_ext=k_new if ext else None, v_ext=v_new if ext else None)
        row: dict = dict(config=cfg.__dict__, ext_rows=ext, default=cfg == ExtendConfig() and ext)
        try:
            run()
            row["max_abs_err_vs_sdpa"] = (out.float() - ref_tok.float()).abs().max().item()
            row["ms"] = median_ms(run)
            row["tflops"] = flops / row["ms"] / 1e9
            if cudnn_ms:
                row["ratio_tflops_to_cudnn"] = cudnn_ms / row["ms"]
            print(f"prefill prefix={prefix} new={new} {cfg} ext={ext}: {row['ms']:.3f} ms {row['tflops']:.1f} TFLOP/s "
                  f"err={row['max_abs_err_vs_sdpa']:.2e}", flush=True)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"prefill {cfg}: {row['error']}", flush=True)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    entry.update(default=next(r for r in rows if r["default"]), sweep=rows,
                 best=min(timed, key=lambda r: r["ms"]) if timed else None)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="new tokens of the no-prefix prefill")
    parser.add_argument("--prefix-tokens", type=int, default=4096, help="cached prefix of the second prefill")
    parser.add_argument("--prefix-new", type=int, default=512, help="new tokens on top of that prefix")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs and split counts")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    results: dict = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                         triton=triton.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                         python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                         timing="triton.testing.do_bench median (warmup 50 ms, rep 300 ms, L2 flushed)")
    def save() -> None:  # after every section, so a run cut short still leaves its numbers
        if args.output:
            args.output.write_text(json.dumps(results, indent=1, default=str))

    bench_decode(args.batch, args.context, args.sweep, results)
    save()
    for prefix, new in ((0, args.prefill_tokens), (args.prefix_tokens, args.prefix_new)):
        results[f"prefill_b4_h32_d128_prefix{prefix}_new{new}"] = prefill_case(prefix, new, args.sweep)
        torch.cuda.empty_cache()
        save()
    print("\nsummary (default configs):")
    cudnn = results["decode_sdpa_cudnn_contiguous"]["ms"]
    print(f"  decode sdpa cudnn contiguous bf16: {cudnn:.4f} ms")
    for key, val in results.items():
        if key.startswith("decode_triton_"):
            d = val["default"]
            best = val["best"]["ms"] if val["best"] else None
            print(f"  {key}: {d.get('ms', float('nan')):.4f} ms, {d.get('tb_per_s', 0):.2f} TB/s, "
                  f"x{d.get('ratio_to_cudnn_bf16', float('nan')):.3f} of cudnn; best config {best} ms")
        if key.startswith("decode_fp8_over"):
            print(f"  {key}: {val:.3f}")
        if key.startswith("prefill_"):
            d = val["default"]
            print(f"  {key}: {d.get('ms', float('nan')):.3f} ms, {d.get('tflops', 0):.1f} TFLOP/s, "
                  f"cudnn ratio {d.get('ratio_tflops_to_cudnn')}; best {val['best'] and val['best']['tflops']}")


if __name__ == "__main__":
    main()
