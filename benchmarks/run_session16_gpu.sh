#!/usr/bin/env bash
# Session 16 device stages (one `run` call for one or more: `bash benchmarks/run_session16_gpu.sh prefill sparse`):
#   prefill  the Triton extend kernel against cuDNN in the same run in head sections (ExtendConfig.section),
#            alternated with the default order (sweep_extend_prefill.py --schedule); the first run also had FMA-pipe
#            exponentials (removed: slower)
#   (sparse: the block-sparse kernel with FMA-pipe exponentials and with key tiles in pairs, both slower and removed;
#    results in benchmarks/results/s16/sweep_block_sparse_*_h100_s16.json)
#   tests    GPU tests of the changed kernels: extend (both program orders) and block-sparse vs float64,
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
    tests) PYTHONPATH=src timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -k "extend or gpu_matches" \
             tests/gpu/test_triton_gpu.py tests/test_block_sparse_attention.py ${TEST_EXTRA:-} 2>&1 | tail -8 ;;
    s15) PYTHONPATH=src timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -k "${S15_K:-engine or graphs or fused_moe or one_batch or add}" tests/gpu/test_mla_gpu.py \
           tests/gpu/test_fused_layers_gpu.py 2>&1 | tail -12 ;;
    moe) PYTHONPATH=src timeout 200 python3 benchmarks/sweep_fused_moe.py --budget-s ${MOE_BUDGET:-150} \
           --out "$OUT/sweep_fused_moe.json" 2>&1 | tail -12 ;;
    ab) . benchmarks/deepseek_ab.sh ;;
    *) echo "unknown stage $stage" ;;
  esac
done
