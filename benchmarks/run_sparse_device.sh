#!/usr/bin/env bash
# Sparse video attention evidence on the lent GPU: GPU tests of the block-sparse kernel, then
# benchmarks/bench_sparse_video.py (correctness vs float64 + timings vs dense cuDNN/FA4 in the same run).
# FA4 is used where it imports from /tmp/site (installed by an earlier call of this machine, or here from
# carried .whl/fa/c1 + .whl/fa/c2 as in shared DEVICE.md). Usage: bash benchmarks/run_sparse_device.sh [TAG]
set -u
TAG=${1:-h100}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. benchmarks/device_fa4_setup.sh
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_block_sparse_attention.py tests/test_sliding_tile.py > "$OUT/gpu_tests_block_sparse_$TAG.txt" 2>&1
tail -3 "$OUT/gpu_tests_block_sparse_$TAG.txt"
[ "${TESTS_ONLY:-0}" = 1 ] && exit 0
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_sparse_video.py ${BENCH_ARGS:-} --out "$OUT/bench_sparse_video_$TAG.json" \
  > "$OUT/bench_sparse_video_$TAG.txt" 2> "$OUT/bench_sparse_video_stderr_$TAG.txt"
echo "bench rc=$?"
tail -5 "$OUT/bench_sparse_video_stderr_$TAG.txt"
tail -8 "$OUT/bench_sparse_video_$TAG.txt"
