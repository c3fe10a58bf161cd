#!/usr/bin/env bash
# Session 20 device stages (one `run` call for one or more: `bash benchmarks/run_session20_gpu.sh tests prefill`).
# Needs the FlashInfer wheels in /tmp/site (DEVICE.md) and, for the A/B stages, the previous tree in .old_src/src.
#   tests    GPU tests of the extend and decode kernels (every launch variant, a pool past 2**31 elements)
#   prefetch the extend kernel with slot ids a tile ahead forced on against its default, cuDNN in the same run
#            (sweep_extend_prefill.py --prefetch): whether causal prefill can now take them too
#   mla      small-batch MLA decode against FlashInfer, both graph-timed (sweep_mla_small_batch.py): 128 heads ctx
#            4096 (DeepSeek-V3's attention) and 16 heads ctx 544/2048 (V2-Lite), batches 1-32
#   fp8cvt   fp8 decode with each fp8 conversion in CONVERTS (default ptx_v,ptx_kv,cast; bits_k is the default
#            launch for e4m3 pools since session 21), pages 1 and 16, bf16 alongside (sweep_fp8_decode.py --converts)
#   prefill  `sglx bench attention --phase prefill --backend triton` (cuDNN and FlashInfer in the same run), the pools
#   decode   in KVS (default "auto fp8_e4m3"), .old_src and this tree alternated in fresh processes (REPS rounds,
#            default 2)
# Every JSON report lands in $OUT/s20.tgz (one file: the device returns only a few files a call).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 COLUMNS=160
SITE=${SITE:-/tmp/site}
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    tests) PYTHONPATH=$PWD/src:$PWD/tests:$SITE timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider \
             -k "extend or decode or past_2_31" -n 4 -p xdist tests/gpu/test_triton_gpu.py tests/gpu/test_fp8_kv_gpu.py ${TEST_EXTRA:-} 2>&1 | tail -8 ;;
    prefill|decode)
      for rep in $(seq 1 "${REPS:-2}"); do
        for tree in old new; do
          src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old_src/src
          for kv in ${KVS:-auto fp8_e4m3}; do
            echo "--- round $rep $tree $kv $(date +%T)"
            PYTHONPATH=$src:$SITE timeout 200 python3 -m sglx bench attention --phase "$stage" --backend triton \
              --kv-cache-dtype "$kv" --output "$WORK/${stage}_${kv}_${tree}_r${rep}.json" 2>&1 \
              | grep -E "triton|cudnn|flashinfer|sdpa" | cut -c1-150
            tar -czf "$OUT/s20.tgz" -C "$WORK" . 2>/dev/null
          done
        done
      done ;;
    prefetch) PYTHONPATH=$PWD/src timeout 400 python3 benchmarks/sweep_extend_prefill.py --prefetch --budget-s 330 \
                --out "$WORK/sweep_extend_prefetch.json" 2>&1 | grep -v Warning | tail -20 ;;
    mla) PYTHONPATH=$PWD/src:$SITE timeout 250 python3 benchmarks/sweep_mla_small_batch.py --heads 128 \
           --contexts 4096 --batches 1,4,16,32 --layers 8 --out "$WORK/mla_small_batch_h128.json" 2>&1 | grep -v Warn
         PYTHONPATH=$PWD/src:$SITE timeout 150 python3 benchmarks/sweep_mla_small_batch.py --heads 16 \
           --out "$WORK/mla_small_batch_h16.json" 2>&1 | grep -v Warn ;;
    fp8cvt) PYTHONPATH=$PWD/src timeout 300 python3 benchmarks/sweep_fp8_decode.py --converts ${CONVERTS:-ptx_v,ptx_kv,cast} \
              --output "$WORK/sweep_fp8_converts.json" 2>&1 | grep -v Warn | tail -16 ;;
    *) echo "unknown stage $stage" ;;
  esac
  tar -czf "$OUT/s20.tgz" -C "$WORK" . 2>/dev/null  # after every stage: a call cut by its limit keeps what ran
done
