"""Why does compiled flex_attention fail on the lent H100 (torch 2.11)? Try sglx's compiled path and variants.

Session 3 saw three failures of tests/gpu/test_flex_gpu.py with compile=on: NoValidChoicesError (no template
choice), "out of resource" shared memory (248832 bytes > 227 KB), and "unbacked_bindings" (soft-cap
score_mod). This probe runs one extend step and one decode step of the failing cases through
FlexAttentionBackend with compile=on, then the same with one change at a time, and checks each result
against float64: which change makes the compiled path lower and agree?

    PYTHONPATH=src:tests python3 benchmarks/probe_flex_compile.py --out $OUT/flex_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

DEV = "cuda"
CASES = {  # name -> (dtype, page, hq, hkv, dim, window, cap): the session-3 failures
    "bf16-p1-32x8-d128": (torch.bfloat16, 1, 32, 8, 128, None, 0.0),
    "bf16-p64-16x2-d64-w700": (torch.bfloat16, 64, 16, 2, 64, 700, 0.0),
    "bf16-p128-32x8-d128-cap30": (torch.bfloat16, 128, 32, 8, 128, None, 30.0),
}
PREFIX = [0, 700, 2000, 37]
NEW = [512, 64, 1, 300]


def run_case(case: str, variant: str) -> dict:
    import torch._dynamo

    from sglx.attention.llm import flex as flexmod
    from sglx.attention.llm.base import BackendContext, LayerSpec
    from sglx.llm.forward_batch import ForwardBatch, ForwardMode
    from triton_interpreted.paged import make_paged_cache, reference_attention

    torch._dynamo.reset()
    flexmod._compiled_flex.cache_clear()
    dtype, page, hq, hkv, dim, window, cap = CASES[case]
    total = [p + n + 1 for p, n in zip(PREFIX, NEW)]
    cache = make_paged_cache(total, page, hkv, dim, dtype, device=DEV, fill=PREFIX, seed=page)
    ctx = BackendContext(torch.device(DEV), dtype, hq, hkv, dim, page, cache.r2t, cache.pool, {"compile": "on"})
    backend = flexmod.FlexAttentionBackend(ctx)
    options: dict = {}
    if variant == "static":
        backend._flex[False] = torch.compile(flexmod._flex_extend, dynamic=False)
    elif variant.startswith("kernel_options"):
        options = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4}
    elif variant == "contiguous_kv":
        orig = backend._pool_kv
        backend._pool_kv = lambda layer, batch: tuple(t.contiguous() for t in orig(layer, batch))  # type: ignore
    elif variant == "no_full_blocks":  # only partial blocks: the template's HAS_FULL_BLOCKS=False path
        init = backend.init_forward_metadata

        def init_partial(batch, init=init):  # type: ignore[no-untyped-def]
            init(batch)
            if backend.step is not None:
                backend.step.full_blocks = False
        backend.init_forward_metadata = init_partial  # type: ignore[method-assign]
    if options:
        for phase in (False, True):
            fn = backend._flex[phase]
            backend._flex[phase] = lambda *a, fn=fn, **k: fn(*a, kernel_options=options, **k)
    layer = LayerSpec(0, hq, hkv, dim, dim ** -0.5, sliding_window=window, logit_cap=cap)
    gen = torch.Generator(device=DEV).manual_seed(1)
    result: dict = {"case": case, "variant": variant}
    lo = list(PREFIX)
    for step, new in (("extend", NEW), ("decode", [1, 1, 1, 1])):
        mode = ForwardMode.EXTEND if step == "extend" else ForwardMode.DECODE
        hi = [a + n for a, n in zip(lo, new)]
        batch = ForwardBatch(
            mode=mode, input_ids=torch.zeros(sum(new), dtype=torch.long, device=DEV),
            positions=torch.cat([torch.arange(a, b, device=DEV) for a, b in zip(lo, hi)]),
            req_pool_indices=torch.tensor(cache.rows, device=DEV), seq_lens=torch.tensor(hi, device=DEV),
            out_cache_loc=torch.cat([cache.slots(i, a, b) for i, (a, b) in enumerate(zip(lo, hi))]),
            req_to_token_pool=cache.r2t, token_kv_pool=cache.pool, seq_lens_cpu=hi,
            extend_seq_lens_cpu=list(new) if mode.is_extend else [],
            extend_prefix_lens_cpu=list(lo) if mode.is_extend else [])
        q = torch.randn(sum(new), hq, dim, generator=gen, device=DEV, dtype=dtype)
        k = torch.cat([kk[a:b] for kk, a, b in zip(cache.raw_keys, lo, hi)])
        v = torch.cat([vv[a:b] for vv, a, b in zip(cache.raw_values, lo, hi)])
        started = time.perf_counter()
        try:
            backend.init_forward_metadata(batch)
            out = backend.forward(q, k, v, layer, batch)
            torch.cuda.synchronize()
        except Exception as exc:  # the point of the probe: record how it fails
            lines = traceback.format_exception_only(type(exc), exc)
            result[step] = {"ok": False, "error": " ".join(lines)[:600], "s": time.perf_counter() - started}
            return result
        row, worst = 0, 0.0
        for i, (a, b) in enumerate(zip(lo, hi)):
            ref = reference_attention(q[row:row + b - a], cache.keys[i][:b], cache.values[i][:b],
                                      torch.arange(a, b, device=DEV), layer.scaling, window, cap)
            worst = max(worst, (out[row:row + b - a].double() - ref).abs().max().item())
            row += b - a
        result[step] = {"ok": worst <= 3e-2, "max_err": worst, "s": time.perf_counter() - started}
        lo = hi
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="baseline,static,no_full_blocks,kernel_options,contiguous_kv")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    started = time.perf_counter()
    results = []
    for case in args.cases.split(","):
        for variant in args.variants.split(","):
            if time.perf_counter() - started > args.budget_s:
                results.append({"case": case, "variant": variant, "skipped": "time budget"})
                continue
            results.append(run_case(case, variant))
            print(json.dumps(results[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, f,
                  indent=2)


if __name__ == "__main__":
    main()
