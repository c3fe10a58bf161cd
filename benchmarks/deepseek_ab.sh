#!/usr/bin/env bash
# DeepSeek-V2-Lite one-batch, this tree against .old_src/src (carried: an earlier commit's src), fresh processes
# alternated in the order of DS_VARIANTS (new_* / old_*), then the step's kernel table (bench_deepseek_step.py) for each
# of DS_STEP (new / old). Sourced by the session device scripts' `ab` stages; OUT must be set.
#   DS_BS (default 1,32)  DS_VARIANTS (default "new_a old_a old_b new_b"; " " for none)  DS_STEP  STEP_TOP (default 12)
DS="--model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 --attention-backend triton
 --batch-size ${DS_BS:-1,32} --input-len 512 --output-len 32"
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
for v in ${DS_STEP:-}; do
  src=src; [ "$v" = old ] && src=.old_src/src
  PYTHONPATH=$src timeout 200 python3 benchmarks/bench_deepseek_step.py --out "$OUT/deepseek_step_$v.json" \
    > /dev/null 2>&1 || echo "deepseek step $v failed"
  python3 -c "
import json
for bs, d in json.load(open('$OUT/deepseek_step_$v.json'))['model']['profiles'].items():
    print('$v bs', bs, 'kernels us/step', round(d['kernel_us_per_step']))
    for k in d['top'][:${STEP_TOP:-12}]: print('  ', k['calls_per_step'], round(k['us_per_step'], 1), k['name'][:60])
" || true
done
