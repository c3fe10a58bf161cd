#!/usr/bin/env bash
# fa4 LLM backend evidence on the lent GPU, in consecutive calls on one warm machine (/tmp survives ~30 s):
#   STAGE=auto  (carry .whl/fa/c1): the fa4 stage if FA4 already imports on this warm machine, else:
#   STAGE=flex  (carry .whl/fa/c1): install the c1 wheels, stash cu13.part_aa, then probe compiled flex_attention
#   STAGE=fa4   (carry .whl/fa/c2): stash part_ab/ac, unpack the CuTe DSL cu13 libraries (AFTER pip, see DEVICE.md),
#               then the fa4 GPU tests, doctor --check, and benchmarks/bench_fa4_llm.py.
# Idempotent: pip is skipped when flash_attn.cute is already in /tmp/site, the unpack when its libs are there.
# Usage: STAGE=fa4 bash benchmarks/run_fa4_llm_device.sh   (writes under $OUT; prints a short summary last)
set -u
OUT=${OUT:-/tmp/out}
STAGE=${STAGE:-fa4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
FA4_PIP_LOG="$OUT/pip.txt" . benchmarks/device_fa4_setup.sh
export PYTHONPATH=$PYTHONPATH:tests
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import flash_attn.cute as c; print('flash_attn.cute imports', getattr(c, '__version__', '?'))" 2>&1 | tail -1
} > "$OUT/device_$STAGE.txt" 2>&1
cat "$OUT/device_$STAGE.txt"
if [ "$STAGE" = auto ]; then  # fa4 when an earlier call on this warm machine already installed it all
  if grep -q "flash_attn.cute imports" "$OUT/device_$STAGE.txt"; then STAGE=fa4; else STAGE=flex; fi
  echo "STAGE=$STAGE"
fi
if [ "$STAGE" = flex ]; then
  timeout "${PROBE_LIMIT:-150}" python3 benchmarks/probe_flex_compile.py --out "$OUT/flex_probe.json" \
    --budget-s "${PROBE_BUDGET:-120}" > "$OUT/flex_probe.txt" 2>&1
  echo "flex probe rc=$?"
  cut -c1-300 "$OUT/flex_probe.txt" | tail -14
  exit 0
fi
timeout "${TEST_LIMIT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=8 \
  tests/gpu/test_fa4_gpu.py ${EXTRA_TESTS:-} > "$OUT/gpu_tests_fa4.txt" 2>&1
echo "fa4 gpu tests rc=$?"
timeout 150 python3 -m sglx doctor --check --family llm > "$OUT/doctor_llm_check_fa4.txt" 2>&1
echo "doctor rc=$?"
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_LIMIT:-120}" python3 benchmarks/bench_fa4_llm.py --out "$OUT/bench_fa4_llm.json" \
    > "$OUT/bench_fa4_llm.txt" 2>&1
  echo "bench rc=$?"
fi
grep -E "passed|failed|error" "$OUT/gpu_tests_fa4.txt" | tail -12
grep -E "fa4|flex" "$OUT/doctor_llm_check_fa4.txt" | head -6
tail -16 "$OUT/bench_fa4_llm.txt" 2>/dev/null
