#!/usr/bin/env bash
# Session 31 on the lent GPU: stages named on the command line run in order; every log and JSON lands in $OUT.
#   fa4        FlashAttention 4 into /tmp/site from the carried .whl/fa/c* (three calls on one warm machine, any
#              order: benchmarks/device_fa4_setup.sh) and xdist from .whl/xdist (idempotent)
#   fa4_tests  tests/gpu/test_mla_gpu.py -k "$FA4_K" (default: every fa4 MLA case and the triton / flashinfer
#              576-latent pairs beside them)
#   prefill    benchmarks/bench_mla_prefill.py: one layer's MLA extend, triton against fa4 (and flashinfer)
#   sweep      benchmarks/sweep_mla_extend.py: triton MLA extend launches at the expanded head dims (192 / 128)
#   router     benchmarks/bench_moe_router.py: the fused router's launches at V2-Lite's batch-1 shape, in graphs
#   gemv       benchmarks/bench_gemv.py --sweep at V2-Lite's q + kv_a and o_proj (norm-inside variants too)
#   gemv_ab    tests/gpu/test_gemv*_gpu.py, then DeepSeek-V2-Lite one-batch bs $GA_BS (default 1; triton, dummy bf16,
#              input 512, output 64) with the short-row GEMV launches ("new") against without them ("old"), fresh
#              processes alternated new old old new (x $GA_ROUNDS, default 1)
#   tier       the whole GPU tier (`pytest -m gpu tests/`, xdist -n $TIER_N, default 6) without FlashInfer or FA4
#              carried (their cases skip), in $TIER_S seconds (default 560)
#   split      the MLA extend GPU tests (triton's 128 + 64 head tiles against float64, the engines against
#              transformers) and benchmarks/sweep_mla_extend.py (split against padded heads, launches)
#   ds         DeepSeek-V2-Lite one-batch (dummy bf16, input 512, output 32) at $DS_BS (default 1,64): triton for
#              both phases against fa4 prefill + triton decode, fresh processes alternated t f f t
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
SITE=/tmp/site; mkdir -p $SITE
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    fa4)
      FA4_PIP_LOG=$OUT/pip_fa4.log source benchmarks/device_fa4_setup.sh
      [ -d $SITE/xdist ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE \
        .whl/xdist/*.whl > "$OUT/pip_xdist.log" 2>&1
      ls /tmp/parts
      PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages python3 -c \
        "import flash_attn.cute as c; print('fa4 ok', c.__file__)" 2>&1 | tail -1 ;;
    fa4_tests)
      PYTHONPATH=$PWD/src:$PWD/tests:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages timeout ${FA4_S:-400} \
        python3 -m pytest -m gpu -q -p no:cacheprovider -n ${FA4_N:-3} -p xdist tests/gpu/test_mla_gpu.py \
        -k "${FA4_K:-fa4 or 576_latent}" 2>&1 | tee "$OUT/fa4_tests.txt" | tail -15 ;;
    prefill)
      PYTHONPATH=$PWD/src:$PWD/tests:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages timeout 300 \
        python3 benchmarks/bench_mla_prefill.py --out "$OUT/mla_prefill.json" 2>&1 | tail -20 ;;
    sweep)
      PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks timeout 400 \
        python3 benchmarks/sweep_mla_extend.py --out "$OUT/sweep_mla_extend.json" 2>&1 | tail -60 ;;
    router)
      PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/bench_moe_router.py --out "$OUT/moe_router.json" 2>&1 | tail -15 ;;
    gemv)
      PYTHONPATH=$PWD/src timeout 300 python3 benchmarks/bench_gemv.py --sweep --shapes "v2-lite q+kv_a,v2-lite o_proj" \
        --out "$OUT/gemv_sweep.json" 2>&1 | tail -40 ;;
    gemv_ab)
      [ "${GA_TESTS:-1}" = 1 ] && PYTHONPATH=$PWD/src:$PWD/tests timeout 200 python3 -m pytest -m gpu -q \
        -p no:cacheprovider tests/gpu/test_gemv_gpu.py tests/gpu/test_gemv_fused_gpu.py 2>&1 \
        | tee "$OUT/gemv_tests.txt" | tail -3
      for round in $(seq ${GA_ROUNDS:-1}); do
      for v in new old old new; do
        PYTHONPATH=$PWD/src timeout 200 python3 -c "
import sys
if '$v' == 'old':  # every GEMV on the launches before session 31
    from sglx.llm.kernels import gemv as g
    plain = g.launch_params
    g.launch_params = lambda n, k, config=g.GemvConfig(), interpret=False, short_rows=None: plain(n, k, config, interpret)
from sglx.cli.app import main
sys.argv = ['sglx'] + sys.argv[1:]
main()" bench one-batch --model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 \
          --attention-backend triton --batch-size ${GA_BS:-1} --input-len 512 --output-len 64 \
          --max-total-tokens 65536 --output "$OUT/gemv_ab_${v}_$round.json" > "$OUT/gemv_ab_${v}_$round.log" 2>&1
        python3 -c "
import json
for r in json.load(open('$OUT/gemv_ab_${v}_$round.json'))['results']:
    print('$v bs', r['batch_size'], 'decode', round(r['decode_step_ms_median'], 4), 'x floor', round(r['ratio_to_floor'], 3))" \
          || tail -5 "$OUT/gemv_ab_${v}_$round.log"
      done; done ;;
    tier)
      [ -d $SITE/xdist ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE \
        .whl/xdist/*.whl > "$OUT/pip_xdist.log" 2>&1
      PYTHONPATH=$PWD/src:$PWD/tests:$SITE timeout ${TIER_S:-560} python3 -m pytest -m gpu -q -p no:cacheprovider \
        -n ${TIER_N:-6} -p xdist --durations=12 tests/ > "$OUT/gpu_tier.txt" 2>&1
      echo "tier rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tier.txt" | tail -30 ;;
    split)
      PYTHONPATH=$PWD/src:$PWD/tests timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py \
        -k "mla_extend_real_shapes or engine_on_gpu or prefill_graphs" 2>&1 | tee "$OUT/split_tests.txt" | tail -4
      PYTHONPATH=$PWD/src:$PWD/tests:$PWD/benchmarks timeout 300 \
        python3 benchmarks/sweep_mla_extend.py --out "$OUT/sweep_split.json" 2>&1 | tail -60 ;;
    ds)
      n=0
      for v in triton fa4 fa4 triton; do
        n=$((n + 1))
        echo "--- $v $(date +%T)"
        if [ $v = fa4 ]; then pair="--prefill-attention-backend fa4 --decode-attention-backend triton"
        else pair="--attention-backend triton"; fi
        PYTHONPATH=$PWD/src:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages timeout 240 python3 -m sglx \
          bench one-batch --model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 $pair \
          --batch-size ${DS_BS:-1,64} --input-len 512 --output-len 32 --max-total-tokens 65536 \
          --output "$OUT/one_batch_v2lite_${v}_r$n.json" > "$OUT/one_batch_v2lite_${v}_r$n.log" 2>&1
        python3 -c "
import json
for r in json.load(open('$OUT/one_batch_v2lite_${v}_r$n.json'))['results']:
    print('$v bs', r['batch_size'], 'prefill ms', round(r['prefill_ms'], 2), 'device', round(r['prefill_device_ms_median'] or 0, 2), 'decode', round(r['decode_step_ms_median'], 3),
          'x floor', round(r['ratio_to_floor'], 3))" || tail -5 "$OUT/one_batch_v2lite_${v}_r$n.log"
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
done
