#!/usr/bin/env bash
# Session 24 device stages (one `run` call for one or more: `bash benchmarks/run_session24_gpu.sh tests fused`).
#   tests    GPU tests of the GEMVs (plain and with epilogues), fused layers, CUDA graphs, Triton backend (engine vs
#            transformers at batch 1 takes the fused route)
#   fused    the GEMVs with epilogues against the unfused kernel pairs, in graphs (bench_gemv_fused.py)
#   ab       one-batch at batch $BS (default 1), Llama-3.1-8B, $AB_SWITCH (default SGLX_GEMV_EPILOGUES; session 25:
#            SGLX_FOLD_NORMS, SGLX_GEMV_PDL; session 27: SGLX_ROW_SCALED_NORMS with BS=64) at each of $AB_VALUES
#            (default "1 0") in turn, fresh processes, $REPS rounds
#   abattn   one-batch at batch $BS, $MODEL (default llama-3.1-8b), each attention choice of $AB_ATTN (default "auto triton"; auto
#            leaves --attention-backend unset, so the engine's measured pick runs; "P+D" is a prefill+decode pair) in turn,
#            fresh processes, $REPS
#            rounds (session 28: the sm90-h200 record's pick with FlashInfer carried against triton)
#   abtree   one-batch at batch 1, Llama-3.1-8B and DeepSeek-V2-Lite, this tree against .old_src/src, alternated
#   profile  where a Llama-3.1-8B batch-1 decode step goes (profile_decode_step.py)
# Every JSON report lands in $OUT/s24.tgz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/stages_work; mkdir -p "$WORK"  # kept across invocations in one call: each tar holds them all
export PYTHONUNBUFFERED=1 COLUMNS=160
SITE=${SITE:-/tmp/site}

# one fresh `sglx bench one-batch` process at batch $BS (default 1; input 512, output 32) of <src> on <model> into
# <json>, its step summarised; the caller's environment (SGLX_* switches) passes through
one_batch_bs1() {
  local src=$1 model=$2 json=$3
  echo "    $model from $src"
  local attn="--attention-backend ${ATTN:-triton}"
  [ "${ATTN:-triton}" = auto ] && attn=""
  case ${ATTN:-triton} in *+*)  # prefill+decode: a hybrid pair
    attn="--prefill-attention-backend ${ATTN%%+*} --decode-attention-backend ${ATTN#*+}" ;; esac
  PYTHONPATH=$src:$SITE timeout 200 python3 -m sglx bench one-batch --model-path "$model" \
    --load-format dummy --dtype bfloat16 $attn --batch-size "${BS:-1}" --input-len 512 \
    --output-len 32 --no-prefill-floor --max-total-tokens 65536 \
    --output "$json" 2>&1 | grep -E "^\S*\s*1 |step|ratio" | cut -c1-160
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(f\"step {r['decode_step_ms_median']:.3f} ms device {r['decode_step_device_ms_median']:.3f} floor {r['floor_ms']:.3f} ratio {r['ratio_to_floor']:.3f}\")" \
    "$json"
  tar -czf "$OUT/s24.tgz" -C "$WORK" . 2>/dev/null
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) PYTHONPATH=$PWD/src:$PWD/tests:$SITE timeout ${TESTS_S:-420} python3 -m pytest -m gpu -q -p no:cacheprovider \
             -n 4 -p xdist ${TESTS:-tests/gpu/test_gemv_fused_gpu.py tests/gpu/test_gemv_gpu.py \
             tests/gpu/test_fused_layers_gpu.py tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_triton_gpu.py \
             tests/gpu/test_fp8_kv_gpu.py} 2>&1 | tail -15 ;;
    fused) PYTHONPATH=$PWD/src timeout 200 python3 benchmarks/bench_gemv_fused.py --out "$WORK/gemv_fused.json" \
             2>&1 | grep -v Warn | cut -c1-200 ;;
    ab)  # one-batch at batch $BS with the switch on and off, fresh processes alternated
      switch=${AB_SWITCH:-SGLX_GEMV_EPILOGUES}
      for rep in $(seq 1 "${REPS:-2}"); do
        for on in ${AB_VALUES:-1 0}; do
          echo "--- round $rep $switch=$on $(date +%T)"
          ( export "$switch=$on"; one_batch_bs1 "$PWD/src" llama-3.1-8b \
              "$WORK/one_batch_llama-3.1-8b_bs${BS:-1}_${switch}${on}_r${rep}.json" )
        done
      done ;;
    abattn)  # one-batch at batch $BS with each attention choice, fresh processes alternated
      for rep in $(seq 1 "${REPS:-2}"); do
        for attn in ${AB_ATTN:-auto triton}; do
          echo "--- round $rep attention $attn $(date +%T)"
          ( export ATTN=$attn; one_batch_bs1 "$PWD/src" "${MODEL:-llama-3.1-8b}" \
              "$WORK/one_batch_${MODEL:-llama-3.1-8b}_bs${BS:-1}_${attn}_r${rep}.json" )
        done
      done ;;
    abtree)  # batch-1 one-batch, this tree against .old_src/src (another tree's src: `git archive <rev> src | tar -x -C
             # .old_src`, embedded models removed; carry .old_src), Llama-3.1-8B and DeepSeek-V2-Lite, fresh processes
      for rep in $(seq 1 "${REPS:-2}"); do
        for tree in new old; do
          src=$PWD/src; [ "$tree" = old ] && src=$PWD/.old_src/src
          for model in llama-3.1-8b deepseek-v2-lite; do
            echo "--- round $rep $tree $(date +%T)"
            one_batch_bs1 "$src" $model "$WORK/one_batch_${model}_${tree}_r${rep}.json"
          done
        done
      done ;;
    profile)
      PYTHONPATH=$PWD/src timeout 240 python3 benchmarks/profile_decode_step.py --output "$WORK/profile_llama8b_bs1.json" \
        2>&1 | grep -v Warn | cut -c1-160 ;;
    *) echo "unknown stage $stage" ;;
  esac
  tar -czf "$OUT/s24.tgz" -C "$WORK" . 2>/dev/null
done
