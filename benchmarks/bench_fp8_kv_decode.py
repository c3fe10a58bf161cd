"""fp8 KV decode with per-token scales vs bf16 cuDNN, and the embedded model's recall with fp8 KV, on one GPU.

Run on a CUDA GPU:  PYTHONPATH=src python3 benchmarks/bench_fp8_kv_decode.py --output fp8.json [--recall 200]
Decode shape (issue 13): B=64, 32 query / 8 KV heads, head dim 128, context 4096, pages 1 and 16 shuffled.
Timed, each after a check against SDPA over what the cache holds (dequantized; per-token: rotated queries over
the rotated keys): SDPA cuDNN on contiguous bf16 KV (the baseline), triton bf16 paged, triton fp8 e4m3 with
one scale per layer (the old path; also at block_n 128), triton fp8 e4m3 with per-token scales in every
`DecodeConfig.token_scale_fold` side by side ("tile_max", the default until session 7, and "exponent", the
default since, also at block_n 128; the default also with the per-layer query rotation), and the K/V store of
one decode step and of a 4096-token prefill. do_bench medians, L2 flushed. --recall N: the embedded model
answering N prompts of 62 pairs, triton first (fp8_e4m3 per-token, the point of the exercise), then
torch_native, auto / fp8_e4m3 / fp8_e5m2 KV with per-token scales and (the old path) one static scale of 1.0
per layer; rows that would run past --budget-s (default 150: the GPU session's step has 170 s, imports
included) are skipped and say so.
The JSON is written after every row. --device cpu runs only the recall, through torch_native.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from bench_triton_decode import DEV, DIM, DTYPE, HKV, HQ, median_ms, paged_indices, sdpa_decode  # noqa: E402

from sglx.attention.kernels.common import num_sms  # noqa: E402
from sglx.attention.kernels.decode_attention import (  # noqa: E402
    DEFAULT_TOKEN_SCALE_FOLD,
    DecodeConfig,
    choose_num_kv_splits,
    decode_attention,
)
from sglx.attention.kernels.store_kv import store_kv, store_kv_to_pool  # noqa: E402
from sglx.llm.kv_cache import TokenKVPool  # noqa: E402

BS, CTX = 64, 4096


POOLS = ("bf16", "fp8_e4m3 per-layer scale", "fp8_e4m3 per-token scales")
# (pool, variant label, launch config): the first of each pool is its default launch
VARIANTS = [
    ("bf16", "default", DecodeConfig()),
    ("fp8_e4m3 per-layer scale", "default", DecodeConfig()),
    ("fp8_e4m3 per-layer scale", "block_n 128", DecodeConfig(block_n=128)),
    ("fp8_e4m3 per-layer scale", "num_stages 2", DecodeConfig(num_stages=2)),
    ("fp8_e4m3 per-token scales", f"default ({DEFAULT_TOKEN_SCALE_FOLD})", DecodeConfig()),
    ("fp8_e4m3 per-token scales", "tile_max (session 6)", DecodeConfig(token_scale_fold="tile_max")),
    ("fp8_e4m3 per-token scales", "exponent", DecodeConfig(token_scale_fold="exponent")),
    ("fp8_e4m3 per-token scales", "exponent block_n 128", DecodeConfig(token_scale_fold="exponent", block_n=128)),
    ("fp8_e4m3 per-token scales", "exponent num_stages 2", DecodeConfig(token_scale_fold="exponent", num_stages=2)),
    ("fp8_e4m3 per-token scales", "exponent ptx_kv", DecodeConfig(token_scale_fold="exponent", fp8_convert="ptx_kv")),
    ("fp8_e4m3 per-token scales", "tile_max block_n 128", DecodeConfig(token_scale_fold="tile_max", block_n=128)),
]
# Static look at these (sm_90a, triton 3.6, ptxas, the bench's strides): SASS instructions per 64 keys of the
# loop / registers: per-layer 577 / 106, at block_n 128 447 / 144, at 2 stages 503 / 96; per-token tile_max
# 829 / 153, exponent 745 / 122, exponent at block_n 128 520 / 144, at 2 stages 676 / 120.


def decode_rows(page: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cudnn_ms: float,
                variants: list[tuple[str, str, DecodeConfig]] = VARIANTS, splits: int = 0) -> list[dict]:
    """Every variant of one pool kind on the same pool, indices, queries and scratch (one process, one shape)."""
    kv_indptr, kv_indices, slots = paged_indices(BS, CTX, page, seed=page)
    loc = kv_indices.long()
    flat_k = k.transpose(1, 2).reshape(-1, HKV, DIM)
    flat_v = v.transpose(1, 2).reshape(-1, HKV, DIM)
    splits = splits or choose_num_kv_splits(BS, HKV, CTX, num_sms(DEV))  # 0: the engine's policy
    mid_o = torch.empty(BS, HQ, splits, DIM, device=DEV)
    mid_lse = torch.empty(BS, HQ, splits, device=DEV)
    rows, per_layer_ms = [], 0.0
    for name in POOLS:
        mine = [(label, config) for pool_name, label, config in variants if pool_name == name]
        if not mine:
            continue
        kv = "auto" if name == "bf16" else "fp8_e4m3"
        pool = TokenKVPool(slots, page, 1, HKV, DIM, DTYPE, kv, DEV, per_token_scales="per-token" in name)
        store_kv_to_pool(pool, 0, flat_k, flat_v, loc)
        got_k, got_v = pool.get_kv(0, loc, DTYPE)  # unrotated, dequantized: what attention should see
        cache_k = got_k.view(BS, CTX, HKV, DIM).transpose(1, 2).contiguous()
        cache_v = got_v.view(BS, CTX, HKV, DIM).transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = sdpa_decode(q, cache_k, cache_v)
        del cache_k, cache_v, got_k, got_v
        out = torch.empty(BS, HQ, DIM, device=DEV, dtype=DTYPE)
        q_rot = pool.rotate_query(q)
        for n, (label, config) in enumerate(mine):
            def kernel(pool=pool, out=out, q_in=q_rot, config=config) -> None:
                decode_attention(q_in, pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr, kv_indices, mid_o,
                                 mid_lse, DIM ** -0.5, k_scale=pool.k_scale[0], v_scale=pool.v_scale[0],
                                 fp8_dtype=pool.fp8_dtype, config=config, page_size=page)

            def with_rotation(pool=pool, out=out, config=config) -> None:
                decode_attention(pool.rotate_query(q), pool.k_buffer[0], pool.v_buffer[0], out, kv_indptr,
                                 kv_indices, mid_o, mid_lse, DIM ** -0.5, k_scale=pool.k_scale[0],
                                 v_scale=pool.v_scale[0], fp8_dtype=pool.fp8_dtype, config=config)

            row: dict = dict(page=page, kv=name, variant=label, splits=splits,
                             config={f: getattr(config, f) for f in ("block_n", "num_stages", "token_scale_fold",
                                                                     "fp8_convert", "tma")
                                     if getattr(config, f) is not None})
            try:
                out.fill_(float("nan"))
                kernel()
                row["max_abs_err_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
                row["ms"] = median_ms(kernel)
                row["over_cudnn_bf16"] = row["ms"] / cudnn_ms
                if name == POOLS[1] and n == 0:
                    per_layer_ms = row["ms"]
                if name == POOLS[2] and per_layer_ms:
                    row["over_per_layer_default"] = row["ms"] / per_layer_ms
                if pool.per_token_scales and n == 0:
                    row["ms_with_query_rotation"] = median_ms(with_rotation)
                    row["with_rotation_over_cudnn_bf16"] = row["ms_with_query_rotation"] / cudnn_ms
            except Exception as exc:  # recorded, not fatal: the other rows still run
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(decode_line(row), flush=True)
        del pool
        torch.cuda.empty_cache()
    return rows


def decode_line(r: dict) -> str:
    """One summary line (the GPU session script greps lines starting with "page")."""
    head = f"page {r['page']:2d} splits {r['splits']} {r['kv']:26s} {r['variant']:22s} "
    if "ms" not in r:
        return head + r.get("error", "")
    extra = f"  +rotation {r['ms_with_query_rotation']:.4f} ms ({r['with_rotation_over_cudnn_bf16']:.3f}x)" \
        if "ms_with_query_rotation" in r else ""
    vs_layer = f" {r['over_per_layer_default']:.3f}x per-layer" if "over_per_layer_default" in r else ""
    return head + (f"{r['ms']:.4f} ms {r['over_cudnn_bf16']:.3f}x cuDNN{vs_layer} err {r['max_abs_err_vs_sdpa']:.1e}"
                   f"{extra}")


def store_rows() -> list[dict]:
    """One decode step's (64 tokens) and one prefill's (4096 tokens) K/V store, per pool kind."""
    rows = []
    for tokens in (BS, 4096):
        k = torch.randn(tokens, HKV, DIM, device=DEV, dtype=DTYPE)
        v = torch.randn(tokens, HKV, DIM, device=DEV, dtype=DTYPE)
        loc = torch.randperm(tokens * 4, device=DEV)[:tokens] + 16
        for name in ("bf16", "fp8_e4m3 per-layer scale", "fp8_e4m3 per-token scales"):
            pool = TokenKVPool(tokens * 4, 16, 1, HKV, DIM, DTYPE, "auto" if name == "bf16" else "fp8_e4m3", DEV,
                               per_token_scales="per-token" in name)
            row: dict = dict(tokens=tokens, kv=name)
            try:
                if pool.per_token_scales:
                    row["ms"] = median_ms(lambda pool=pool, k=k, v=v, loc=loc: store_kv_to_pool(pool, 0, k, v, loc))
                else:
                    row["ms"] = median_ms(lambda pool=pool, k=k, v=v, loc=loc: store_kv(
                        k, v, pool.k_buffer[0], pool.v_buffer[0], loc, 1.0, 1.0, pool.fp8_dtype))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(store_line(row), flush=True)
    return rows


RECALL_KV = ("fp8_e4m3", "auto", "fp8_e5m2", "fp8_e4m3 static", "fp8_e5m2 static")  # most wanted first
FIRST_ROW_S = 30.0  # guessed length of the first recall row (session 6's H100: the triton rows fit in ~100 s)


def recall_rows(n: int, device: str, backends: list[str], deadline: float, on_row=lambda rows: None) -> list[dict]:
    """Exact answers of the embedded model; "static" rows give the backend one scale of 1.0 per layer (the old path).

    Rows in order backend-major, RECALL_KV order within; a row that would end after `deadline` (time.monotonic(),
    judged by the longest row so far, FIRST_ROW_S before the first) is recorded as skipped. `on_row` gets the
    rows after each one.
    """
    from sglx.attention.llm.torch_native import TorchNativeBackend
    from sglx.attention.llm.triton import TritonBackend
    from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
    from sglx.llm.engine import Engine

    rng = random.Random(11)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(n)]
    prompts, answers = [p for p, _ in examples], [a for _, a in examples]
    rows = []
    classes = {"triton": TritonBackend, "torch_native": TorchNativeBackend}
    took: list[float] = []
    for backend in backends:
        for kv in RECALL_KV:
            row: dict = dict(backend=backend, kv_cache_dtype=kv, prompts=n, pairs=MAX_PAIRS)
            start, need = time.monotonic(), max(took, default=FIRST_ROW_S)
            if start + need > deadline:
                row["skipped"] = f"budget: {deadline - start:.0f} s left, a row takes {need:.0f} s"
                rows.append(row)
                print(recall_line(row), flush=True)
                continue
            classes[backend].kv_scales_per_token = not kv.endswith("static")
            try:
                scales = "one" if kv.endswith("static") else "auto"  # static: the old path, one scale of 1.0 per layer
                with Engine(attention_backend=backend, kv_cache_dtype=kv.split()[0], kv_cache_scales=scales,
                            device=device) as eng:
                    row["dtype"] = str(eng.runner.dtype)
                    row["per_token_scales"] = bool(getattr(eng.runner.token_kv_pool, "per_token_scales", False))
                    results = eng.generate(prompts, {"max_new_tokens": 8, "temperature": 0.0})
                row["accuracy"] = sum(normalize_output(r["text"]) == a for r, a in zip(results, answers)) / n
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                classes[backend].kv_scales_per_token = True
            row["seconds"] = round(time.monotonic() - start, 1)
            took.append(row["seconds"])
            rows.append(row)
            print(recall_line(row), flush=True)
            on_row(rows)
    return rows


def recall_line(r: dict) -> str:
    head = f"recall {r['backend']:12s} {r['kv_cache_dtype']:16s} "
    if "accuracy" in r:
        return head + f"{r['accuracy']:.3f} ({r['dtype']}, {r['seconds']} s)"
    return head + (r.get("error") or f"skipped ({r['skipped']})")


def store_line(r: dict) -> str:
    return f"store {r['tokens']:5d} tokens {r['kv']:26s} " + (f"{r['ms']:.4f} ms" if "ms" in r else r["error"])


def main() -> None:
    started = time.monotonic()
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="bench_fp8_kv_decode.json")
    ap.add_argument("--recall", type=int, default=0)
    ap.add_argument("--recall-only", action="store_true", help="skip the kernel timings")
    ap.add_argument("--recall-backends", default=None,
                    help="comma-separated, in order (default: triton,torch_native on cuda, torch_native on cpu)")
    ap.add_argument("--no-store", action="store_true", help="skip the K/V store timings")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="recall rows that would end later than this many seconds after start are skipped")
    ap.add_argument("--device", default="cuda", help="cpu: recall only, through torch_native")
    ap.add_argument("--pages", default="1,16", help="comma-separated page sizes of the decode timings")
    ap.add_argument("--splits", default="0",
                    help="comma-separated KV split counts the decode timings run at (0: the engine's policy)")
    ap.add_argument("--tma", action="store_true",
                    help="time each pool's default launch and K/V by TMA (DecodeConfig.tma) instead of the variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        args.recall_only = True
    result: dict = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                        torch=torch.__version__, triton=triton.__version__)
    print(f"{result['device']} torch {result['torch']} triton {result['triton']}", flush=True)
    if not args.recall_only:
        result["shape"] = dict(batch=BS, context=CTX, q_heads=HQ, kv_heads=HKV, head_dim=DIM, dtype=str(DTYPE))
        result["default_token_scale_fold"] = DEFAULT_TOKEN_SCALE_FOLD
    out = Path(args.output)
    result["decode"], result["store"] = [], []
    if not args.recall_only:
        k = torch.randn(BS, HKV, CTX, DIM, device=DEV, dtype=DTYPE)
        v = torch.randn(BS, HKV, CTX, DIM, device=DEV, dtype=DTYPE)
        q = torch.randn(BS, HQ, DIM, device=DEV, dtype=DTYPE)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            result["cudnn_bf16_ms"] = cudnn = median_ms(lambda q=q, k=k, v=v: sdpa_decode(q, k, v))
        print(f"{result['device']} cuDNN bf16 contiguous {cudnn:.4f} ms", flush=True)  # in the session summary
        variants = VARIANTS
        if args.tma:
            variants = [(pool, label, config) for pool in POOLS for label, config in
                         (("default", DecodeConfig()), ("tma", DecodeConfig(tma=True)),
                          ("tma, num_stages 4", DecodeConfig(tma=True, num_stages=4)),
                          ("tma, block_n 128", DecodeConfig(tma=True, block_n=128)))]
        for page, splits in ((int(x), int(n)) for x in args.pages.split(",") for n in args.splits.split(",")):
            result["decode"] += decode_rows(page, q, k, v, cudnn, variants, splits)
            out.write_text(json.dumps(result, indent=1))  # after every section: a timeout keeps what was measured
        result["decode_seconds"] = round(time.monotonic() - started, 1)
        del k, v
        torch.cuda.empty_cache()
        if not args.no_store:
            result["store"] = store_rows()
            out.write_text(json.dumps(result, indent=1))
    if args.recall:
        backends = (args.recall_backends.split(",") if args.recall_backends
                    else ["triton", "torch_native"] if args.device == "cuda" else ["torch_native"])

        def save(rows: list[dict]) -> None:
            result["recall"] = rows
            out.write_text(json.dumps(result, indent=1))

        save(recall_rows(args.recall, args.device, backends, started + args.budget_s, save))
    result["seconds"] = round(time.monotonic() - started, 1)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
