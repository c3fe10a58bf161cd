#!/usr/bin/env bash
# Session 23 device stages (one `run` call for one or more: `bash benchmarks/run_session23_gpu.sh profile`).
#   profile  where a batch-1 decode step goes today: Llama-3.1-8B (profile_decode_step.py) and DeepSeek-V2-Lite
#            (bench_deepseek_step.py: one-batch bs 1 and 32, kernel tables of graph-replayed steps)
#   tests    GPU tests of the GEMV, the skinny GEMM, the fused layers, CUDA graphs and MLA models (engine vs transformers)
#   ab       one-batch at batch 1, Llama-3.1-8B and DeepSeek-V2-Lite, SGLX_GEMV=1 / 0 alternated in fresh processes
#   gemv     one-row projections in graphs: cuBLAS, the skinny GEMM, the CUDA-core GEMV's launch sweep (bench_gemv.py)
# Every JSON report lands in $OUT/s23.tgz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 COLUMNS=160
SITE=${SITE:-/tmp/site}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    profile)
      PYTHONPATH=$PWD/src timeout 240 python3 benchmarks/profile_decode_step.py --output "$WORK/profile_llama8b_bs1.json" \
        2>&1 | grep -v Warn | cut -c1-160
      PYTHONPATH=$PWD/src timeout 300 python3 benchmarks/bench_deepseek_step.py --out "$WORK/deepseek_step.json" \
        2>&1 | grep -v Warn | cut -c1-160 ;;
    gemv) PYTHONPATH=$PWD/src timeout 500 python3 benchmarks/bench_gemv.py --sweep --out "$WORK/gemv_sweep.json" \
            2>&1 | grep -v Warn | cut -c1-200 ;;
    tests) PYTHONPATH=$PWD/src:$PWD/tests:$SITE timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -p xdist \
             tests/gpu/test_gemv_gpu.py tests/gpu/test_skinny_gemm_gpu.py tests/gpu/test_fused_layers_gpu.py \
             tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_mla_gpu.py 2>&1 | tail -15 ;;
    ab)  # batch-1 one-batch with the GEMV path on and off (SGLX_GEMV), fresh processes alternated
      for rep in $(seq 1 "${REPS:-2}"); do
        for gemv in 1 0; do
          for model in llama-3.1-8b deepseek-v2-lite; do
            echo "--- round $rep SGLX_GEMV=$gemv $model $(date +%T)"
            SGLX_GEMV=$gemv PYTHONPATH=$PWD/src timeout 150 python3 -m sglx bench one-batch --model-path $model \
              --load-format dummy --dtype bfloat16 --attention-backend triton --batch-size 1 --input-len 512 \
              --output-len 32 --no-prefill-floor --max-total-tokens 65536 \
              --output "$WORK/one_batch_${model}_gemv${gemv}_r${rep}.json" 2>&1 | grep -E "^\S*\s*1 |step|ratio" | cut -c1-160
            python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(f\"step {r['decode_step_ms_median']:.3f} ms device {r['decode_step_device_ms_median']:.3f} floor {r['floor_ms']:.3f} ratio {r['ratio_to_floor']:.3f}\")" \
              "$WORK/one_batch_${model}_gemv${gemv}_r${rep}.json"
            tar -czf "$OUT/s23.tgz" -C "$WORK" . 2>/dev/null
          done
        done
      done ;;
    gemvnorm) PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/bench_gemv.py --shapes "llama qkv,llama gate_up,v2-lite q+kv_a" \
                --out "$WORK/gemv_norm.json" 2>&1 | grep -v Warn | cut -c1-200 ;;
    *) echo "unknown stage $stage" ;;
  esac
  tar -czf "$OUT/s23.tgz" -C "$WORK" . 2>/dev/null
done
