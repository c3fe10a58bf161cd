#!/usr/bin/env bash
# Session 14 device stages (one `run` call each; carry .whl for stage tests, .old_src for stage ab):
#   tests  GPU tests of what session 14 changed (L2 prefetch, MLA/DeepSeek kernels and engine, CUDA graphs)
#   ab     DeepSeek-V2-Lite one-batch (bs 1, 32): this tree against .old_src (session 13's src), alternated;
#          then the step's kernel table (bench_deepseek_step.py, DS_STEP="new old"); then, with L2_VARIANTS, Llama-3.1-8B
#          bs1 processes under SGLX_L2_PREFETCH values (the switch existed only in session 14's first commits)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
stage=${1:?stage: tests | mla_tests | ab}
if [ "$stage" = tests ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl > "$OUT/pip.txt" 2>&1
  export PYTHONPATH=src:/tmp/site MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
  timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_l2_prefetch_gpu.py tests/gpu/test_mla_gpu.py \
    tests/gpu/test_cuda_graph_gpu.py 2>&1 | tail -25
fi
if [ "$stage" = mla_tests ]; then  # carry .whl too (FlashInfer MLA); then run stage ab in the same call
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl > "$OUT/pip.txt" 2>&1
  PYTHONPATH=src:/tmp/site MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a timeout 300 python3 -m pytest -m gpu -q \
    -p no:cacheprovider tests/gpu/test_mla_gpu.py 2>&1 | tail -8
  stage=ab
fi
if [ "$stage" = ab ]; then
  DS="--model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 --attention-backend triton --batch-size 1,32
   --input-len 512 --output-len 32"
  show() { python3 -c "
import json
for r in json.load(open('$1'))['results']:
    print('$2', 'bs', r['batch_size'], 'decode', round(r['decode_step_ms_median'],3), 'device', round(r['decode_step_device_ms_median'],3), 'x floor', round(r['ratio_to_floor'],3))
" || echo "$2 failed"; }
  for v in ${DS_VARIANTS:-new_a old_a old_b new_b}; do
    src=src; [ "${v%_*}" = old ] && src=.old_src/src
    # shellcheck disable=SC2086
    PYTHONPATH=$src timeout 170 python3 -m sglx bench one-batch $DS --output "$OUT/ds_$v.json" > /dev/null 2>&1
    show "$OUT/ds_$v.json" "v2lite $v"
  done
  for v in ${DS_STEP:-new}; do  # the step's kernel table: this tree (new) and/or session 13's (old)
    src=src; [ "$v" = old ] && src=.old_src/src
    PYTHONPATH=$src timeout 200 python3 benchmarks/bench_deepseek_step.py --out "$OUT/deepseek_step_$v.json" \
      > /dev/null 2>&1 || echo "deepseek step $v failed"
    python3 -c "
import json
d = json.load(open('$OUT/deepseek_step_$v.json'))['model']['profiles']['1']
print('$v bs1 kernels us/step', round(d['kernel_us_per_step']))
for k in d['top']: print('  ', k['calls_per_step'], round(k['us_per_step'], 1), k['name'][:70])
" || true
  done
  OB="--model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-size 1 --input-len 512 --output-len 32
   --attention-backend triton --page-size 128"
  for v in ${L2_VARIANTS:-}; do
    # shellcheck disable=SC2086
    PYTHONPATH=src SGLX_L2_PREFETCH=${v#*:} timeout 100 python3 -m sglx bench one-batch $OB --output "$OUT/l2_${v%%:*}.json" \
      > /dev/null 2>&1
    show "$OUT/l2_${v%%:*}.json" "8b ${v%%:*}"
  done
fi
