"""fp8 per-layer scales calibrated from a first prefill of ONE short prompt (a server's first client) instead of the
200-prompt batch: recall of the embedded model through torch_native, with and without layer 1 kept unquantized.

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/recall_fp8_first_prefill.py SEED  (JSON lines on stdout;
recorded in benchmarks/results/fp8_kv_calibration_first_prefill_cpu.json)
"""
import json
import random
import sys
import time

import torch

from sglx.llm.embedded.task import MAX_PAIRS, make_example, normalize_output
from sglx.llm.engine import Engine

torch.set_num_threads(1)
seed = int(sys.argv[1])
rng = random.Random(seed)
ex = [make_example(rng, MAX_PAIRS) for _ in range(200)]
first = make_example(random.Random(99), 4)[0]  # a short 4-pair prompt calibrates
for skip in (None, "1"):
    for warm in (None, first):
        t = time.time()
        with Engine(attention_backend="torch_native", kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate",
                    device="cpu", kv_cache_dtype_skip_layers=skip) as eng:
            if warm:
                eng.generate(warm, {"max_new_tokens": 8, "temperature": 0.0})
            res = eng.generate([p for p, _ in ex], {"max_new_tokens": 8, "temperature": 0.0})
            sc = eng.runner.token_kv_pool.describe_scales()
        right = sum(normalize_output(r["text"]) == a for r, (_, a) in zip(res, ex))
        print(json.dumps(dict(seed=seed, skip=skip, first_prefill="one 4-pair prompt" if warm else "the 200 prompts",
                              correct=right, accuracy=right / 200, k_scale=sc["k_scale"],
                              s=round(time.time() - t, 1))), flush=True)
