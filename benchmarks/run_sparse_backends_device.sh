#!/usr/bin/env bash
# Sparse video backends on the lent GPU in two consecutive calls (FA4's wheels are split over two carries; /tmp
# on the machine survives while it stays warm, ~30 s after a call):
#   PHASE=1, carry [".whl/fa/c1", ".whl/fvs", ".whl/fvx"]: installs FA4's first half; GPU tests of the block-sparse kernel
#     and the sparse backends on the Triton route; `sglx doctor --family diffusion --check` (real sparse calls);
#     launch sweep of the Triton kernel (sweep_block_sparse.py).
#   PHASE=2, carry [".whl/fa/c2", ".whl/fvs"]: unpacks FA4's cu13 libs; VSA/VMoBA/SVG2 vs dense cuDNN and FA4 plus
#     upstream VSA (bench_sparse_backends.py); STA vs dense, upstream STA and the step-level reorder
#     (bench_sparse_video.py) and the 18x48x80 Wan step with the tile order kept; the 480p Wan step with each
#     sparse backend; doctor --check again (FA4 route); STA's GPU tests on the FA4 route; tables last.
# .whl/fvs holds fastvideo-kernel 0.3.4's Python package, .whl/fvx its compiled extension (xz) and cudart (the
# wheel's bundled libcuda, 96 MB, is replaced by the machine's). PHASE=solo (carry .whl/fvs, .whl/fvx): one call
# without FA4. Timeouts per step: T_TESTS, T_DOCTOR, T_SWEEP, T_BACKENDS, T_VIDEO, T_STEP, T_FA4TESTS; CASES.
# Usage: PHASE=1 bash <this> [TAG]
set -u
TAG=${1:-h100}
PHASE=${PHASE:-1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. benchmarks/device_fa4_setup.sh
# fastvideo-kernel: its Python package (.whl/fvs) plus, carried in phase 1 (.whl/fvx), its compiled extension
# and bundled cudart, with the machine's libcuda under the bundled name. Used only if the extension imports in a
# separate process; otherwise the Python package alone (upstream then runs its Triton paths).
if [ -d .whl/fvx ] && [ ! -d /tmp/fvk ]; then
  mkdir -p /tmp/fvk_try/fastvideo_kernel.libs && cp -r .whl/fvs/fastvideo_kernel /tmp/fvk_try/
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    .whl/fvx/fastvideo_kernel_ops.so.xz /tmp/fvk_try/fastvideo_kernel/_C/fastvideo_kernel_ops.cpython-312-x86_64-linux-gnu.so
  cp .whl/fvx/libcudart-* /tmp/fvk_try/fastvideo_kernel.libs/
  ln -sf "$(ldconfig -p | grep -m1 'libcuda.so.1 ' | awk '{print $NF}')" /tmp/fvk_try/fastvideo_kernel.libs/libcuda-dcdf334a.so.580.178.04
  if PYTHONPATH=/tmp/fvk_try timeout 60 python3 -c "import torch; from fastvideo_kernel._C import fastvideo_kernel_ops as o; print('fastvideo_kernel compiled ops:', [n for n in ('sta_fwd', 'block_sparse_fwd') if hasattr(o, n)])" > /tmp/fvk_try.log 2>&1; then
    mv /tmp/fvk_try /tmp/fvk
  fi
  tail -2 /tmp/fvk_try.log
fi
FV=.whl/fvs
[ -d /tmp/fvk ] && FV=/tmp/fvk
export PYTHONPATH=$PYTHONPATH:$FV
echo "fastvideo_kernel from $FV"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
TESTS="tests/test_block_sparse_attention.py tests/test_sliding_tile.py tests/test_sparse_backends.py"
if [ "$PHASE" = solo ]; then  # one call, no FA4 carried: Triton route only, GPU tests first, then phase 2's runs
  timeout ${T_TESTS:-45} python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider $TESTS > "$OUT/gpu_tests_sparse_triton_$TAG.txt" 2>&1
  tail -4 "$OUT/gpu_tests_sparse_triton_$TAG.txt"
fi
if [ "$PHASE" = 1 ]; then
  timeout ${T_TESTS:-45} python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider $TESTS > "$OUT/gpu_tests_sparse_triton_$TAG.txt" 2>&1
  tail -4 "$OUT/gpu_tests_sparse_triton_$TAG.txt"
  COLUMNS=220 timeout ${T_DOCTOR:-25} python3 -m sglx doctor --family diffusion --check > "$OUT/doctor_sparse_check_$TAG.txt" 2>&1
  grep -E "sliding|video_sparse|vmoba|sparse_video" "$OUT/doctor_sparse_check_$TAG.txt" | head -8
  timeout ${T_SWEEP:-65} python3 benchmarks/sweep_block_sparse.py --out "$OUT/sweep_block_sparse_$TAG.json" \
    > "$OUT/sweep_block_sparse_$TAG.txt" 2>&1
  echo "sweep rc=$?"
  tail -4 "$OUT/sweep_block_sparse_$TAG.txt"
  exit 0
fi
timeout ${T_BACKENDS:-55} python3 benchmarks/bench_sparse_backends.py --out "$OUT/sparse_backends_$TAG.json" \
  > "$OUT/sparse_backends_$TAG.txt" 2>&1
echo "backends bench rc=$?"
timeout ${T_VIDEO:-95} python3 benchmarks/bench_sparse_video.py --no-sweep --no-step --step-order \
  --cases "${CASES:-18x48x80 3x3x3 (85%),wan1.3b-480p 3x3x3}" \
  --out "$OUT/bench_sparse_video_$TAG.json" > "$OUT/bench_sparse_video_$TAG.txt" 2>&1
echo "video bench rc=$?"
timeout ${T_STEP:-60} python3 benchmarks/bench_sparse_video.py --no-sweep --no-step --sparse-step --cases none \
  --out "$OUT/bench_sparse_step_$TAG.json" > "$OUT/bench_sparse_step_$TAG.txt" 2>&1
echo "sparse step rc=$?"
COLUMNS=220 timeout ${T_DOCTOR:-20} python3 -m sglx doctor --family diffusion --check > "$OUT/doctor_sparse_check_fa4_$TAG.txt" 2>&1
grep -E "sliding|video_sparse|vmoba|sparse_video" "$OUT/doctor_sparse_check_fa4_$TAG.txt" | head -8
timeout ${T_FA4TESTS:-15} python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/test_sliding_tile.py -k fa4 \
  > "$OUT/gpu_tests_sparse_fa4_$TAG.txt" 2>&1
tail -2 "$OUT/gpu_tests_sparse_fa4_$TAG.txt"
tail -2 "$OUT/bench_sparse_step_$TAG.txt"
tail -5 "$OUT/bench_sparse_video_$TAG.txt"
tail -16 "$OUT/sparse_backends_$TAG.txt"
