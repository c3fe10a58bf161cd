#!/usr/bin/env bash
# Session 15 device stages (one `run` call each; carry .old_src for stage ab):
#   sweep  fused-MoE launch sweep at DeepSeek-V2-Lite's decode shapes (benchmarks/sweep_fused_moe.py; MOE_SWEEP=0
#          skips it) and the MLA decode kernel at batches 1-4 with V2-Lite's 16 heads (sweep_mla_small_batch.py:
#          one graph of a call per layer), over split sizes and tiles
#   decode the Triton MHA decode kernel at Llama-3.1-8B's one-batch shapes (sweep_decode_graphed.py: one graph of a
#          call per layer): batch 1 over split sizes and tiles, batch 64 over tiles, stages and TMA
#   mla    MLA decode split sizes (32 or 64 keys) at batches 8-32, 16 heads
#   tests  GPU tests of what session 15 changed (fused MoE / norm, MLA engine and graphs, fused layers)
#   ab     DeepSeek-V2-Lite one-batch (bs 1, 32): this tree against .old_src (session 14's src), alternated
#          (DS_VARIANTS), then the step's kernel table of this tree (DS_STEP)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
stage=${1:?stage: sweep | decode | mla | tests | ab}
if [ "$stage" = sweep ]; then
  [ "${MOE_SWEEP:-1}" = 1 ] && PYTHONPATH=src timeout 280 python3 benchmarks/sweep_fused_moe.py --budget-s 240 --out "$OUT/sweep_fused_moe.json" \
    2>&1 | tail -6
  # shellcheck disable=SC2086
  PYTHONPATH=src timeout 240 python3 benchmarks/sweep_mla_small_batch.py --out "$OUT/mla_small_batch.json" \
    --sweep ${MLA_SWEEP:-min_chunk=16,32,64 block_n=16,32 num_stages=1,2 num_warps=2,4} 2>&1 | tail -45
fi
if [ "$stage" = decode ]; then
  # shellcheck disable=SC2086
  PYTHONPATH=src timeout 200 python3 benchmarks/sweep_decode_graphed.py --cases 1:544,1:2048 --page 128 \
    --sweep ${BS1_SWEEP:-min_chunk=16,32,64 block_n=16,32,64 num_stages=2,3 num_warps=2,4} \
    --out "$OUT/decode_graphed_bs1.json" 2>&1 | tail -16
  # shellcheck disable=SC2086
  PYTHONPATH=src timeout 200 python3 benchmarks/sweep_decode_graphed.py --cases 64:544,64:2048 --page 128 \
    --sweep ${BS64_SWEEP:-block_n=32,64 num_stages=2,3,4 num_warps=4,8 tma=0,1} \
    --out "$OUT/decode_graphed_bs64.json" 2>&1 | tail -16
fi
if [ "$stage" = mla ]; then  # MLA decode split sizes at V2-Lite's batches past 4 (16 heads)
  PYTHONPATH=src timeout 200 python3 benchmarks/sweep_mla_small_batch.py --batches ${MLA_BATCHES:-8,16,32} \
    --contexts 544 --sweep min_chunk=32,64 --out "$OUT/mla_batches.json" 2>&1 | tail -12
fi
if [ "$stage" = tests ]; then
  PYTHONPATH=src timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py tests/gpu/test_fused_layers_gpu.py \
    ${TEST_EXTRA:-} 2>&1 | tail -15
fi
if [ "$stage" = ab ]; then
  # shellcheck source=benchmarks/deepseek_ab.sh
  . benchmarks/deepseek_ab.sh
fi
