"""fa4 (sglx backend and the raw flash_attn.cute call) vs triton vs cuDNN SDPA, in one process on one GPU.

Shapes from issue 12: paged decode B=64, Hq 32 / Hkv 8, head dim 128, 4096-token contexts on scattered
128-token pages; causal prefill B=4, 32 heads, head dim 128, 4096 new tokens. bf16. Each route is first
compared with another (fa4 backend vs raw fa4 vs cuDNN vs float64 on sampled requests) and then timed
(sglx.bench.timing: median of many runs, L2 flushed before each). The SDPA baseline is the best of its
backends (cuDNN, then FLASH) on contiguous K/V: BHSD for prefill, BHSD with enable_gqa for decode.
The backends' per-step metadata (page table) is built once outside the timed call: every layer reuses it.

    PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python3 benchmarks/bench_fa4_llm.py \
        --out $OUT/bench_fa4_llm.json
"""

from __future__ import annotations

import argparse
import json
import platform as py_platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglx.attention.llm.base import BackendContext, LayerSpec
from sglx.bench.timing import TimingBudget, cuda_graphed, median_ms
from sglx.llm.forward_batch import ForwardBatch, ForwardMode
from sglx.llm.kv_cache import ReqToTokenPool, TokenKVPool

DEV = torch.device("cuda")
DT = torch.bfloat16
PAGE = 128
BUDGET = TimingBudget(warmup_ms=25, rep_ms=200)


def paged_setup(batch: int, hkv: int, dim: int, context: int, gen: torch.Generator):
    """`batch` requests of `context` tokens on shuffled 128-token pages; returns (r2t, pool, rows, K, V contiguous)."""
    pages_per = -(-context // PAGE)
    num_slots = (batch * pages_per + 1) * PAGE
    r2t = ReqToTokenPool(batch, context + PAGE, DEV)
    pool = TokenKVPool(num_slots, PAGE, 1, hkv, dim, DT, device=DEV)
    order = (torch.randperm(batch * pages_per, generator=gen) + 1).view(batch, pages_per)
    slots = (order[:, :, None] * PAGE + torch.arange(PAGE)).reshape(batch, -1)[:, :context].to(DEV)
    r2t.req_to_token[1:batch + 1, :context] = slots.int()
    k = torch.randn(batch, context, hkv, dim, generator=gen).to(DEV, DT)
    v = torch.randn(batch, context, hkv, dim, generator=gen).to(DEV, DT)
    pool.k_buffer[0][slots.reshape(-1)] = k.reshape(-1, hkv, dim)
    pool.v_buffer[0][slots.reshape(-1)] = v.reshape(-1, hkv, dim)
    return r2t, pool, torch.arange(1, batch + 1, device=DEV), k, v


def make_backend(name: str, r2t, pool, hq: int, hkv: int, dim: int):
    from sglx.attention.registry import find

    ctx = BackendContext(DEV, DT, hq, hkv, dim, PAGE, r2t, pool)
    return find(name, "llm", "mha").load()(ctx)


def sdpa_best(fn: Callable[[], torch.Tensor]) -> tuple[str, Callable[[], torch.Tensor]]:
    """The fastest SDPA backend that runs this call (cuDNN first): the vendor baseline."""
    best = None
    for label, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                      ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(be=be) -> torch.Tensor:
            with sdpa_kernel([be]):
                return fn()
        try:
            call()
        except RuntimeError:
            continue
        t = median_ms(call, DEV, BUDGET).median_ms
        if best is None or t < best[0]:
            best = (t, label, call)
    assert best is not None, "no SDPA backend runs this shape"
    return best[1], best[2]


def timed(fn: Callable[[], object]) -> float:
    return median_ms(fn, DEV, BUDGET).median_ms


def bench_decode(batch=64, hq=32, hkv=8, dim=128, context=4096) -> dict:
    from flash_attn.cute import flash_attn_varlen_func

    gen = torch.Generator().manual_seed(0)
    r2t, pool, rows, k, v = paged_setup(batch, hkv, dim, context, gen)
    q = torch.randn(batch, hq, dim, generator=gen).to(DEV, DT)
    lens = torch.full((batch,), context, device=DEV)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(batch, dtype=torch.long, device=DEV),
                      positions=lens - 1, req_pool_indices=rows, seq_lens=lens,
                      out_cache_loc=torch.zeros(batch, dtype=torch.long, device=DEV), req_to_token_pool=r2t,
                      token_kv_pool=pool, seq_lens_cpu=[context] * batch)
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5)
    out: dict = {"shape": f"decode B{batch} Hq{hq}/Hkv{hkv} D{dim} context {context} page {PAGE} bf16"}
    routes: dict[str, Callable[[], torch.Tensor]] = {}
    for name in ("fa4", "triton"):
        be = make_backend(name, r2t, pool, hq, hkv, dim)
        be.init_forward_metadata(fb)
        routes[f"sglx {name}"] = lambda be=be: be.forward_decode(q, q, q, layer, fb, save_kv_cache=False)
    for name in ("fa4", "triton"):
        try:
            routes[f"sglx {name} (CUDA graph)"] = cuda_graphed(routes[f"sglx {name}"])
        except Exception as exc:  # recorded, not fatal: the eager routes still run
            out[f"sglx {name} (CUDA graph) error"] = f"{type(exc).__name__}: {exc}"
    fa4 = make_backend("fa4", r2t, pool, hq, hkv, dim)
    fa4.init_forward_metadata(fb)
    meta = fa4.meta
    kc, vc = pool.k_buffer[0].view(-1, PAGE, hkv, dim), pool.v_buffer[0].view(-1, PAGE, hkv, dim)
    routes["raw fa4 varlen (paged)"] = lambda: flash_attn_varlen_func(
        q.view(batch, 1, hq, dim), kc, vc, seqused_k=meta.seq_lens, page_table=meta.page_table,
        softmax_scale=layer.scaling, causal=True, num_splits=1)[0].view(batch, hq, dim)
    kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    label, sdpa = sdpa_best(lambda: F.scaled_dot_product_attention(q[:, :, None], kt, vt, scale=layer.scaling,
                                                                   enable_gqa=True)[:, :, 0])
    routes[f"sdpa {label} contiguous"] = sdpa
    ref = None
    for b in (0, batch - 1):  # float64 on two requests
        kk = k[b].double().repeat_interleave(hq // hkv, 1)
        vv = v[b].double().repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,khd->hk", q[b].double(), kk) * layer.scaling, -1)
        r = torch.einsum("hk,khd->hd", p, vv)
        ref = r[None] if ref is None else torch.cat([ref, r[None]])
    kv_bytes = 2 * batch * context * hkv * dim * 2
    for name, fn in routes.items():
        o = fn()
        err = (o[[0, batch - 1]].double() - ref).abs().max().item()
        ms = timed(fn)
        out[name] = {"ms": ms, "max_abs_err_vs_float64": err, "kv_GBps": kv_bytes / ms / 1e6}
    base = out[f"sdpa {label} contiguous"]["ms"]
    for name in routes:
        out[name]["vs_sdpa"] = out[name]["ms"] / base
    out["sglx fa4 / raw fa4"] = out["sglx fa4"]["ms"] / out["raw fa4 varlen (paged)"]["ms"]
    return out


def bench_prefill(batch=4, heads=32, dim=128, seq=4096) -> dict:
    from flash_attn.cute import flash_attn_func

    gen = torch.Generator().manual_seed(1)
    r2t, pool, rows, k, v = paged_setup(batch, heads, dim, seq, gen)
    q = torch.randn(batch, seq, heads, dim, generator=gen).to(DEV, DT)
    lens = torch.full((batch,), seq, device=DEV)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.zeros(batch * seq, dtype=torch.long, device=DEV),
                      positions=torch.arange(seq, device=DEV).repeat(batch), req_pool_indices=rows, seq_lens=lens,
                      out_cache_loc=torch.zeros(batch * seq, dtype=torch.long, device=DEV), req_to_token_pool=r2t,
                      token_kv_pool=pool, seq_lens_cpu=[seq] * batch, extend_seq_lens_cpu=[seq] * batch,
                      extend_prefix_lens_cpu=[0] * batch)
    layer = LayerSpec(0, heads, heads, dim, dim ** -0.5)
    qf = q.reshape(-1, heads, dim)
    kf, vf = k.reshape(-1, heads, dim), v.reshape(-1, heads, dim)
    out: dict = {"shape": f"causal prefill B{batch} H{heads} D{dim} seq {seq} bf16 (sglx: paged, page {PAGE})"}
    routes: dict[str, Callable[[], torch.Tensor]] = {}
    for name in ("fa4", "triton"):
        be = make_backend(name, r2t, pool, heads, heads, dim)
        be.init_forward_metadata(fb)
        routes[f"sglx {name}"] = lambda be=be: be.forward_extend(qf, kf, vf, layer, fb, save_kv_cache=False)
    routes["raw fa4 dense"] = lambda: flash_attn_func(q, k, v, softmax_scale=layer.scaling, causal=True)[0].reshape(
        -1, heads, dim)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    label, sdpa = sdpa_best(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=layer.scaling))
    routes[f"sdpa {label} BHSD"] = sdpa  # timed as called: its [B, H, S, D] output is compared transposed below
    ref = routes["raw fa4 dense"]()
    flops = 4 * batch * heads * seq * seq * dim / 2
    for name, fn in routes.items():
        got = fn()
        if got.dim() == 4:
            got = got.transpose(1, 2).reshape(-1, heads, dim)
        err = (got.float() - ref.float()).abs().max().item()
        ms = timed(fn)
        out[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "max_abs_diff_vs_raw_fa4": err}
    base = out[f"sdpa {label} BHSD"]["ms"]
    for name in routes:
        out[name]["vs_sdpa"] = out[name]["ms"] / base
    out["sglx fa4 / raw fa4"] = out["sglx fa4"]["ms"] / out["raw fa4 dense"]["ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import flash_attn.cute as cute
    import triton

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "triton": triton.__version__, "flash_attn_cute": getattr(cute, "__version__", "?"),
              "python": py_platform.python_version()}
    for name, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
        try:
            report[name] = fn()
        except Exception as exc:  # report what ran; the other phase still runs
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("device", "torch")}))
    for phase in ("decode", "prefill"):
        res = report[phase]
        print(f"== {phase}: {res.get('shape', res.get('error'))}")
        for name, row in res.items():
            if isinstance(row, dict):
                extra = f"{row['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in row else f"{row['kv_GBps']:.0f} GB/s"
                err = row.get("max_abs_err_vs_float64", row.get("max_abs_diff_vs_raw_fa4"))
                print(f"  {name:28s} {row['ms']:8.3f} ms  {extra:>14s}  x{row['vs_sdpa']:.3f} of sdpa  err {err:.2e}")
        if "sglx fa4 / raw fa4" in res:
            print(f"  sglx fa4 / raw fa4 = {res['sglx fa4 / raw fa4']:.3f}")


if __name__ == "__main__":
    main()
