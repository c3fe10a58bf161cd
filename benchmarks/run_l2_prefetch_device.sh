#!/usr/bin/env bash
# Session 14 (one device call, no carries): the L2 weight-prefetch probe, then Llama-3.1-8B one-batch (triton, page
# 128, bs 1 and 64) with SGLX_L2_PREFETCH off / on, alternated, fresh process each; then budget variants.
# The engine read SGLX_L2_PREFETCH only at 0277620 (removed in 99eb5ae): at any later commit the one-batch runs
# here are the same code under different names; the probe still measures the prefetch itself.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 benchmarks/probe_l2_prefetch.py --output "$OUT/probe_l2_prefetch.json" 2>&1 | tail -20
OB="--model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-size 1,64 --input-len 512 --output-len 32
 --attention-backend triton --page-size 128"
run() {  # name, SGLX_L2_PREFETCH value
  # shellcheck disable=SC2086
  SGLX_L2_PREFETCH="$2" timeout 110 python3 -m sglx bench one-batch $OB --output "$OUT/ob_$1.json" > "$OUT/ob_$1.txt" 2>&1
  python3 -c "
import json
for r in json.load(open('$OUT/ob_$1.json'))['results']:
    print('$1', 'bs', r['batch_size'], 'decode', round(r['decode_step_ms_median'],3), 'device', r['decode_step_device_ms_median'], 'x floor', round(r['ratio_to_floor'],3))
" || { echo "$1 failed"; tail -5 "$OUT/ob_$1.txt"; }
}
for v in ${L2_VARIANTS:-off_a:0 on_a:1 on_b:1 off_b:0 big:o_proj=all,gate_up=16,down=12,qkv=24,lm_head=24 oonly:o_proj=all,gate_up=0,down=0,qkv=0,lm_head=0}; do
  run "${v%%:*}" "${v#*:}"
done
