#!/usr/bin/env bash
# Session 16 device stages (one `run` call for one or more: `bash benchmarks/run_session16_gpu.sh prefill sparse`):
#   prefill  the Triton extend kernel against cuDNN in the same run in head sections (ExtendConfig.section),
#            alternated with the default order (sweep_extend_prefill.py --schedule); the first run also had FMA-pipe
#            exponentials (removed: slower)
#   sparse   the block-sparse kernel's default launch against key tiles in pairs on STA, VSA (both canvases)
#            (sweep_block_sparse.py --pairs); the first run compared FMA-pipe exponentials (removed: slower)
#   tests    GPU tests of the changed kernels: extend (default and head sections) and block-sparse vs float64,
#            plus TEST_EXTRA
#   s15      session 15's GPU tests never run on its shipped tree (MLA engine/graphs, fused MoE incl. persistent,
#            fused layers)
#   moe      the persistent one-launch MoE against two launches (sweep_fused_moe.py), MLA split sweep skipped
#   ab       DeepSeek-V2-Lite one-batch: this tree against .old_src, alternated (benchmarks/deepseek_ab.sh)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    prefill) PYTHONPATH=src timeout 300 python3 benchmarks/sweep_extend_prefill.py --schedule --budget-s 260 \
               --out "$OUT/sweep_extend_schedule.json" 2>&1 | grep -v Warning | tail -36 ;;
    sparse) PYTHONPATH=src timeout 240 python3 benchmarks/sweep_block_sparse.py --pairs \
              --out "$OUT/sweep_block_sparse_pairs.json" 2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line); print(r['case'], r['block_m'], r['block_n'], r['warps'], r['stages'], 'pairs' if r['pairs'] else 'single', r.get('ms'), r.get('rel_err'), r.get('error', ''))
    except Exception:
        print(line.rstrip()[:200])" ;;
    tests) PYTHONPATH=src timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -k "extend or gpu_matches" \
             tests/gpu/test_triton_gpu.py tests/test_block_sparse_attention.py ${TEST_EXTRA:-} 2>&1 | tail -8 ;;
    s15) PYTHONPATH=src timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py \
           tests/gpu/test_fused_layers_gpu.py 2>&1 | tail -12 ;;
    moe) PYTHONPATH=src timeout 280 python3 benchmarks/sweep_fused_moe.py --budget-s 240 \
           --out "$OUT/sweep_fused_moe.json" 2>&1 | tail -12 ;;
    ab) . benchmarks/deepseek_ab.sh ;;
    *) echo "unknown stage $stage" ;;
  esac
done
