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
  DS_STEP=${DS_STEP:-new}
  # shellcheck source=benchmarks/deepseek_ab.sh
  . benchmarks/deepseek_ab.sh
  OB="--model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-size 1 --input-len 512 --output-len 32
   --attention-backend triton --page-size 128"
  for v in ${L2_VARIANTS:-}; do
    # shellcheck disable=SC2086
    PYTHONPATH=src SGLX_L2_PREFETCH=${v#*:} timeout 100 python3 -m sglx bench one-batch $OB --output "$OUT/l2_${v%%:*}.json" \
      > /dev/null 2>&1
    show "$OUT/l2_${v%%:*}.json" "8b ${v%%:*}"
  done
fi
