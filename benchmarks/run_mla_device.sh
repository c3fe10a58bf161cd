#!/usr/bin/env bash
# GPU evidence for issue 14 (MLA) in one call on the lent machine: the MLA -m gpu tests, the triton MLA
# decode kernel vs FlashInfer MLA at DeepSeek-V3's shape (checked vs float64 first; a block-size sweep),
# and one-batch on a dummy DeepSeek-V2-Lite (bf16, triton MLA, CUDA graphs; then eager).
# FlashInfer comes from wheels in .whl/ (see /work/shared/DEVICE.md), installed into /tmp/site.
# Usage: OUT=dir bash benchmarks/run_mla_device.sh        (SWEEP=0 skips the kernel sweep)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
echo "== MLA gpu tests"
PYTHONPATH=src timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py \
  2>&1 | tee "$OUT/pytest_mla_gpu.log" | tail -25
echo "== MLA decode: triton vs FlashInfer (B64 H128 512+64 ctx 4096)"
PYTHONPATH=src:/tmp/site timeout 240 python3 benchmarks/bench_mla_decode.py --out "$OUT/mla_decode.json" 2>&1 \
  | tee "$OUT/mla_decode.log" | tail -8
if [ "${SWEEP:-1}" = 1 ]; then
  echo "== MLA decode sweep (page 1, bf16)"
  PYTHONPATH=src:/tmp/site timeout 240 python3 benchmarks/bench_mla_decode.py --pages 1 --kv-cache-dtypes auto \
    --sweep block_h=16,32,64 num_warps=4,8 block_n=16,32 num_stages=1,2 --out "$OUT/mla_decode_sweep.json" 2>&1 \
    | tail -3 | cut -c1-400
fi
echo "== one-batch, dummy DeepSeek-V2-Lite (CUDA graphs)"
PYTHONPATH=src timeout 300 python3 -m sglx bench one-batch --model-path deepseek-v2-lite --load-format dummy \
  --dtype bfloat16 --attention-backend triton --batch-size 1,32 --input-len 512 --output-len 32 \
  --max-total-tokens 65536 --output "$OUT/one_batch_v2_lite.json" 2>&1 | tee "$OUT/one_batch.log" | tail -12
echo "== one-batch, dummy DeepSeek-V2-Lite (eager)"
PYTHONPATH=src timeout 200 python3 -m sglx bench one-batch --model-path deepseek-v2-lite --load-format dummy \
  --dtype bfloat16 --attention-backend triton --batch-size 1,32 --input-len 512 --output-len 16 \
  --max-total-tokens 65536 --disable-cuda-graph --output "$OUT/one_batch_v2_lite_eager.json" 2>&1 | tail -8
