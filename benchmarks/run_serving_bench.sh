#!/usr/bin/env bash
# `sglx bench serving` against `sglx serve` on one GPU: the embedded model, then Llama-3.1-8B shapes on
# dummy weights. Each case first runs `sglx bench offline-throughput` with the same engine flags and the
# same prompts (same dataset options and seed), so the serving report carries its serving/offline ratio
# (issue 13: at least 0.9x). Usage: OUT=dir bash benchmarks/run_serving_bench.sh
set -u
OUT=${OUT:-/tmp/sglx-serving}
mkdir -p "$OUT"
run() {  # name port serve-args... -- bench-args...
  local name=$1 port=$2; shift 2
  local serve_args=() bench_args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do serve_args+=("$1"); shift; done
  shift
  bench_args=("$@")
  python3 -m sglx bench offline-throughput "${serve_args[@]}" "${bench_args[@]}" \
    --output-file "$OUT/offline_$name.json" > "$OUT/offline_$name.txt" 2>&1
  echo "offline exit code ($name): $?"
  python3 -m sglx serve --port "$port" "${serve_args[@]}" > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 "$pid" 2> /dev/null || { echo "sglx serve ($name) exited before it was healthy:"; tail -5 "$OUT/serve_$name.log"; return 1; }
    sleep 1
  done
  local compare=()
  [ -s "$OUT/offline_$name.json" ] && compare=(--offline-result "$OUT/offline_$name.json")
  python3 -m sglx bench serving --base-url "http://127.0.0.1:$port" --disable-progress \
    --output-file "$OUT/serving_$name.json" "${compare[@]}" "${bench_args[@]}"
  curl -s "http://127.0.0.1:$port/server_info" > "$OUT/server_info_$name.json"
  kill -TERM "$pid"; wait "$pid"
  echo "serve exit code ($name): $?"
}
run embedded 30001 -- --num-prompts 400 --max-concurrency 32 --random-input-len 256 --random-output-len 64 \
  --random-range-ratio 0.5
run llama31_8b_dummy 30002 --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 -- \
  --num-prompts 400 --max-concurrency 64 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0.5
