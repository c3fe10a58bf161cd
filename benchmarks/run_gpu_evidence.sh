#!/usr/bin/env bash
# GPU evidence for issue 5 in one run on the lent machine (see docs/benchmarks.md):
# the -m gpu tests, `sglx bench attention` (default GPU suite, with SDPA cuDNN and FlashInfer
# baselines) and `sglx bench one-batch` (Llama-3.1-8B shapes, dummy bf16 weights, CUDA graphs).
# FlashInfer comes from wheels in .whl/ (installed into /tmp/site, kept off the tests' path).
# Usage: OUT=dir bash benchmarks/run_gpu_evidence.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
echo "== gpu tests"
PYTHONPATH=src timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "== bench attention"
PYTHONPATH=src:/tmp/site timeout 260 python3 -m sglx bench attention --output "$OUT/attention.json" 2>&1 \
  | tee "$OUT/attention.log" | tail -40
echo "== bench one-batch (CUDA graphs)"
PYTHONPATH=src timeout 120 python3 -m sglx bench one-batch --model-path llama-3.1-8b --load-format dummy \
  --dtype bfloat16 --attention-backend triton --batch-size 1,64 --input-len 512 --output-len 32 \
  --output "$OUT/one_batch.json" 2>&1 | tee "$OUT/one_batch.log" | tail -12
[ "${SKIP_EAGER:-0}" = 1 ] && exit 0
echo "== bench one-batch (eager, batch 1)"
PYTHONPATH=src timeout 45 python3 -m sglx bench one-batch --model-path llama-3.1-8b --load-format dummy \
  --dtype bfloat16 --attention-backend triton --batch-size 1 --input-len 512 --output-len 32 --disable-cuda-graph \
  --output "$OUT/one_batch_eager.json" 2>&1 | tail -8
