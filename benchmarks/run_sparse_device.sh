#!/usr/bin/env bash
# Sparse video attention evidence on the lent GPU: GPU tests of the block-sparse kernel, then
# benchmarks/bench_sparse_video.py (correctness vs float64 + timings vs dense cuDNN/FA4 in the same run).
# FA4 is used where it imports from /tmp/site (installed by an earlier call of this machine, or here from
# carried .whl/fa/c1 + .whl/fa/c2 as in shared DEVICE.md). Usage: bash benchmarks/run_sparse_device.sh [TAG]
set -u
TAG=${1:-h100}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/parts /tmp/site
export PYTHONUNBUFFERED=1
for d in .whl/fa/c1 .whl/fa/c2; do
  [ -d "$d" ] && cp -n "$d"/cu13.part_* /tmp/parts/ 2>/dev/null
done
if [ -d .whl/fa/c1 ] && [ ! -d /tmp/site/flash_attn ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fa/c1/*.whl > /dev/null 2>&1
fi
if [ ! -d /tmp/site/nvidia_cutlass_dsl/lib ] && [ "$(ls /tmp/parts/cu13.part_* 2>/dev/null | wc -l)" = 3 ]; then
  cat /tmp/parts/cu13.part_* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
fi
export PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_block_sparse_attention.py tests/test_sliding_tile.py > "$OUT/gpu_tests_block_sparse_$TAG.txt" 2>&1
tail -3 "$OUT/gpu_tests_block_sparse_$TAG.txt"
[ "${TESTS_ONLY:-0}" = 1 ] && exit 0
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_sparse_video.py ${BENCH_ARGS:-} --out "$OUT/bench_sparse_video_$TAG.json" \
  > "$OUT/bench_sparse_video_$TAG.txt" 2> "$OUT/bench_sparse_video_stderr_$TAG.txt"
echo "bench rc=$?"
tail -5 "$OUT/bench_sparse_video_stderr_$TAG.txt"
tail -8 "$OUT/bench_sparse_video_$TAG.txt"
