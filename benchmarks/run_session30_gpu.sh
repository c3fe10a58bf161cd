#!/usr/bin/env bash
# Session 30 on the lent GPU: stages named on the command line run in order; every log and JSON lands in $OUT.
#   fi           FlashInfer (+ xdist) into /tmp/site from the carried .whl/fi and .whl/xdist (idempotent)
#   mla_tests    tests/gpu/test_mla_gpu.py -k "$MLA_K" (default: triton MLA prefill graphs, engine vs transformers,
#                graphs vs eager, the 576-latent pairs, the dummy V2-Lite one-batch)
#   align_tests  tests/gpu/test_mla_gpu.py -k "align or fused_moe" (both moe_align launch shapes against a stable
#                torch sort up to 320k pairs, fused MoE against the loop)
#   align        benchmarks/bench_moe_align.py: one program, three launches, torch sort; eager and graph-replayed
#   ds           DeepSeek-V2-Lite one-batch (triton, dummy bf16, input 512, output 32) at $DS_BS (default 1,64),
#                this tree ("new") against session 29's alignment ("old": one program up to 12,288 pairs, the torch
#                sort past it), fresh processes alternated new old old new
#   dsprof       benchmarks/bench_deepseek_step.py --batch-sizes $DS_BS: the decode step's kernel table
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
SITE=/tmp/site; mkdir -p $SITE
export PYTHONPATH=$PWD/src:$PWD/tests:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    fi)  # the same install as session 29's
      OUT=$OUT bash benchmarks/run_session29_gpu.sh fi | tail -1 ;;
    mla_tests)  # session 29's `mla` stage with this session's default selection
      MLA_K=${MLA_K:-prefill_graphs or engine_on_gpu or cuda_graphs_equal or 576_latent or one_batch} OUT=$OUT \
        MLA_S=${MLA_S:-420} bash benchmarks/run_session29_gpu.sh mla | tail -15 ;;
    align_tests)
      timeout ${AT_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py \
        -k "align or fused_moe" 2>&1 | tee "$OUT/align_tests.txt" | tail -8 ;;
    align)
      timeout 300 python3 benchmarks/bench_moe_align.py --out "$OUT/moe_align.json" 2>&1 | tail -25 ;;
    ds)
      for v in new old old new; do
        echo "--- $v $(date +%T)"
        timeout 240 python3 -c "
import sys, torch
if '$v' == 'old':
    from moe_align_reference import align_by_torch_sort
    from sglx.llm.kernels import fused_moe, moe_align as ma
    def old(ids, experts, block_m, one_program=None):
        if ids.numel() > 12288 and not torch.cuda.is_current_stream_capturing():
            return align_by_torch_sort(ids, experts, block_m)
        return ma.moe_align(ids, experts, block_m, one_program=True)
    fused_moe.moe_align = old
from sglx.cli.app import main
sys.argv = ['sglx'] + sys.argv[1:]
main()" bench one-batch --model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 \
          --attention-backend triton --batch-size ${DS_BS:-1,64} --input-len 512 --output-len 32 \
          --max-total-tokens 65536 --output "$OUT/one_batch_v2lite_$v.json" > "$OUT/one_batch_v2lite_$v.log" 2>&1
        python3 -c "
import json
for r in json.load(open('$OUT/one_batch_v2lite_$v.json'))['results']:
    print('$v bs', r['batch_size'], 'prefill ms', round(r['prefill_ms'], 2), 'device', round(r['prefill_device_ms_median'] or 0, 2), 'decode', round(r['decode_step_ms_median'], 3),
          'x floor', round(r['ratio_to_floor'], 3))" || tail -5 "$OUT/one_batch_v2lite_$v.log"
      done ;;
    dsprof)
      timeout 300 python3 benchmarks/bench_deepseek_step.py --batch-sizes ${DS_BS:-1,64} \
        --out "$OUT/deepseek_step.json" 2>&1 | tail -50 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
