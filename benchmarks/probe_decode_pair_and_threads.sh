#!/usr/bin/env bash
# Session 11 probe (one device call, carry .whl/fi): (1) is FlashInfer decode slower than triton end to end at
# bs64 because of the page size or the backend? 8B one-batch bs64, triton page 1 / triton page 128 /
# triton prefill + flashinfer decode page 128, each process alternated twice; (2) do torch's CPU threads make the
# host noisy? offline throughput (llama-3.2-1b, overlap on) with default threads vs OMP_NUM_THREADS=1, alternated.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl > "$OUT/pip.txt" 2>&1
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
OB="--model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-size 64 --input-len 512 --output-len 32"
declare -A CFG=([t1]="--attention-backend triton --page-size 1" [t128]="--attention-backend triton --page-size 128"
  [fi128]="--prefill-attention-backend triton --decode-attention-backend flashinfer --page-size 128")
for round in a b; do
  for c in t1 t128 fi128; do
    # shellcheck disable=SC2086
    timeout 120 python3 -m sglx bench one-batch $OB ${CFG[$c]} --output "$OUT/ob_${c}_$round.json" > "$OUT/ob_${c}_$round.txt" 2>&1
    python3 -c "import json;r=json.load(open('$OUT/ob_${c}_$round.json'))['results'][0];print('$c $round decode', round(r['decode_step_ms_median'],3), 'device', r['decode_step_device_ms_median'], 'prefill', round(r['prefill_ms'],1))" || echo "$c $round failed"
  done
done
OFF="--model-path llama-3.2-1b --load-format dummy --dtype bfloat16 --attention-backend triton --num-prompts 1000
 --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5"
# shellcheck disable=SC2086
timeout 90 python3 -m sglx bench offline-throughput --device cuda $OFF --output-file "$OUT/warm.discard" > /dev/null 2>&1
for round in a b; do
  for t in default one; do
    # shellcheck disable=SC2086
    if [ $t = one ]; then env OMP_NUM_THREADS=1 timeout 90 python3 -m sglx bench offline-throughput --device cuda $OFF \
      --output-file "$OUT/off_${t}_$round.json" > "$OUT/off_${t}_$round.txt" 2>&1
    else timeout 90 python3 -m sglx bench offline-throughput --device cuda $OFF --output-file "$OUT/off_${t}_$round.json" \
      > "$OUT/off_${t}_$round.txt" 2>&1; fi
    python3 -c "import json;d=json.load(open('$OUT/off_${t}_$round.json'));print('threads $t $round', round(d['output_token_throughput']), 'tok/s', round(d['duration_s'],2), 's cpu', round(d['cpu_s'],1), d['environment']['torch_threads'])" || echo "off $t $round failed"
  done
done
