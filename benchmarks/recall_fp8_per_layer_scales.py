"""The embedded model's recall with fp8 KV read through ONE K and ONE V scale per layer (FlashInfer's contract).

Usage: PYTHONPATH=src python benchmarks/recall_fp8_per_layer_scales.py --prompts 200 --output out.json
Runs torch_native with --kv-cache-scales one / calibrate / auto; static pools give the arithmetic FlashInfer and
XQA do (stored fp8 * layer scale). Schemes: "one" (1.0, the old default), "one_rotated" (1.0, keys rotated),
"calibrated" (vLLM's --calculate-kv-scales: first prefill batch amax / 200 for K, / 100 for V, then frozen),
"calibrated_rotated" (the same over rotated keys: --kv-cache-scales calibrate) and "per_token" (what
torch_native/triton use by default, for reference). Same prompts as benchmarks/bench_fp8_kv_decode.py --recall
(seed 11, 62 pairs).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

SCHEMES = ("one", "one_rotated", "calibrated", "calibrated_rotated", "per_token")


def setup_pool(pool, scheme: str) -> None:  # noqa: ANN001
    """Put an empty static pool in the scheme's state."""
    if scheme == "one_rotated":
        from sglx.llm.kv_cache import kv_rotation

        pool.k_rotation = kv_rotation(pool.head_dim, pool.device)
        pool.scale_source = "one_rotated"
    elif scheme == "calibrated":  # --kv-cache-scales calibrate rotates keys; this variant does not
        pool.calibrate_static_scales(rotate_keys=False)


def least_error_scale(x: torch.Tensor, base: float, fp8_dtype: torch.dtype, steps: int) -> float:
    """Among base * 2^(j/steps), j < steps, the scale whose fp8 rounding of x has the least squared error."""
    xf = x.detach().float().reshape(-1)
    errors = [(float(((xf / (base * 2.0 ** (j / steps))).to(fp8_dtype).float() * base * 2.0 ** (j / steps) - xf)
                     .square().sum()), base * 2.0 ** (j / steps)) for j in range(steps)]
    return min(errors)[1]


def with_k_search(pool, steps: int) -> None:  # noqa: ANN001
    """Wrap the pool's calibration: each layer's K scale is then searched (`least_error_scale`)."""
    calibrate = pool.calibrate_layer

    def searched(layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pending = pool.scales_pending[layer_id]
        calibrate(layer_id, k, v)
        if pending and not pool.scales_pending[layer_id]:
            keys = k.float() @ pool.k_rotation if pool.k_rotation is not None else k
            pool.k_scale[layer_id] = least_error_scale(keys, pool.k_scale[layer_id], pool.fp8_dtype, steps)

    pool.calibrate_layer = searched


def keep_layers_exact(pool, layers: list[int]) -> None:  # noqa: ANN001
    """Experiment: the given layers' K/V are read back unrounded (as if those layers stayed in the model dtype)."""
    rows = pool.k_buffer[0].shape[0]
    exact = {i: (torch.zeros(rows, pool.num_kv_heads, pool.head_dim), torch.zeros(rows, pool.num_kv_heads,
                                                                                  pool.v_head_dim)) for i in layers}
    set_kv, get_kv = pool.set_kv, pool.get_kv

    def exact_set(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        set_kv(layer_id, loc, k, v)
        if layer_id in exact:
            exact[layer_id][0][loc] = k.reshape(k.shape[0], pool.num_kv_heads, -1).float()
            exact[layer_id][1][loc] = v.reshape(v.shape[0], pool.num_kv_heads, -1).float()

    def exact_get(layer_id: int, loc: torch.Tensor, dtype: torch.dtype | None = None):  # noqa: ANN202
        if layer_id in exact:
            return exact[layer_id][0][loc].to(dtype or pool.dtype), exact[layer_id][1][loc].to(dtype or pool.dtype)
        return get_kv(layer_id, loc, dtype)

    pool.set_kv, pool.get_kv = exact_set, exact_get


def recall(scheme: str, kv: str, prompts: list[str], answers: list[str], seed_note: str, k_search: int = 0,
           exact_layers: tuple[int, ...] = (), skip_layers: str | None = None) -> dict:
    from sglx.llm.embedded.task import MAX_PAIRS, normalize_output
    from sglx.llm.engine import Engine

    start = time.perf_counter()
    mode = "auto" if scheme == "per_token" else "one" if scheme.startswith("one") else "calibrate"
    with Engine(attention_backend="torch_native", kv_cache_dtype=kv, kv_cache_scales=mode, device="cpu",
                kv_cache_dtype_skip_layers=skip_layers) as eng:
        pool = eng.runner.token_kv_pool
        setup_pool(pool, scheme)
        if k_search and scheme.startswith("calibrated"):
            with_k_search(pool, k_search)
        if exact_layers:
            keep_layers_exact(pool, list(exact_layers))
        results = eng.generate(prompts, {"max_new_tokens": 8, "temperature": 0.0})
        scales = pool.describe_scales()
        bytes_per_token = pool.bytes_per_token()
        dtype = str(eng.runner.dtype)
    right = sum(normalize_output(r["text"]) == a for r, a in zip(results, answers))
    return dict(backend="torch_native", kv_cache_dtype=kv, scheme=scheme, prompts=len(prompts), pairs=MAX_PAIRS,
                prompt_seed=seed_note, dtype=dtype, correct=right, accuracy=right / len(prompts), scales=scales,
                kv_bytes_per_token=bytes_per_token,
                seconds=round(time.perf_counter() - start, 1))


def main() -> None:
    from sglx.llm.embedded.task import MAX_PAIRS, make_example

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--kv", default="fp8_e4m3")
    ap.add_argument("--exact-layers", default="", help="comma-separated layers read back unrounded (experiment: "
                    "what keeping those layers out of fp8 would give)")
    ap.add_argument("--k-search", type=int, default=0, help="calibrated schemes: then pick the K scale among "
                    "scale * 2^(j/N), j < N, with the least squared rounding error over the first batch (experiment)")
    ap.add_argument("--k-range", type=float, default=None, help="calibrated schemes: store the first batch's "
                    "largest |K| (and |V|) as this value instead of vLLM's 200 (100 for V)")
    ap.add_argument("--skip-layers", default=None, help="--kv-cache-dtype-skip-layers: these layers keep the model "
                    "dtype (static-scale schemes)")
    ap.add_argument("--output", default="recall_fp8_per_layer_scales_cpu.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    examples = [make_example(rng, MAX_PAIRS) for _ in range(args.prompts)]
    prompts, answers = [p for p, _ in examples], [a for _, a in examples]
    out = Path(args.output)
    result: dict = dict(device="cpu", processor=platform.processor() or platform.machine(), torch=torch.__version__,
                        threads=torch.get_num_threads(), rows=[])
    if out.exists():
        result = json.loads(out.read_text())
    from sglx.llm import kv_scale_calibration

    if args.k_range:
        kv_scale_calibration.K_RANGE = kv_scale_calibration.V_RANGE = args.k_range
    for scheme in args.schemes.split(","):
        exact = tuple(int(x) for x in args.exact_layers.split(",") if x)
        row = recall(scheme, args.kv, prompts, answers, str(args.seed), args.k_search, exact, args.skip_layers)
        if args.skip_layers:
            row["skip_layers"] = args.skip_layers
        if exact:
            row["exact_layers"] = list(exact)
        if scheme.startswith("calibrated"):
            row["k_range"], row["v_range"] = kv_scale_calibration.K_RANGE, kv_scale_calibration.V_RANGE
            row["k_search_steps"] = args.k_search
        print(row, flush=True)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
