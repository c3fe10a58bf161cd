"""The embedded model's recall in bfloat16 (the dtype of tests/gpu/test_flashinfer_gpu.py's skip-layers test) on
the CPU through torch_native: bf16 KV, fp8_e4m3 with calibrated per-layer scales, and the same with layer 1 kept in
bf16 (--kv-cache-dtype-skip-layers 1). Same 100 prompts as the GPU test (seed 2024, 62 pairs).

Usage: OMP_NUM_THREADS=1 PYTHONPATH=src:tests python benchmarks/recall_fp8_skip_layers_bf16.py  (JSON lines;
recorded in benchmarks/results/fp8_kv_skip_layers_bf16_recall_cpu.json)
"""

import json
import time

from llm_test_utils import embedded_recall

for kw in (dict(kv_cache_dtype="auto"), dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate"),
           dict(kv_cache_dtype="fp8_e4m3", kv_cache_scales="calibrate", kv_cache_dtype_skip_layers="1")):
    t = time.time()
    r, a, pool = embedded_recall(num_prompts=100, seed=2024, attention_backend="torch_native", dtype="bfloat16", **kw)
    print(json.dumps(dict(kw, dtype="bfloat16", right=r, asked=a, s=round(time.time() - t, 1))), flush=True)
