#!/usr/bin/env bash
# Session 12's device calls (H100, one GPU). Usage on the device: bash benchmarks/run_session12_gpu.sh <A|B|C>
#   A  carry [".whl/fi"], timeout 600: the CUDA-graph GPU tests (session 11's shared capture loop had run only on the
#      CPU); FlashInfer's graph replay / engine tests with the cheap replay re-plan and strided decode queries; the
#      8B one-batch at bs 1 and 64, triton page 128 against triton prefill + flashinfer decode page 128, alternated.
#   B  no carry, timeout 600: Triton extend-kernel sweep (TMA for this step's K/V) against cuDNN; the block-sparse
#      sweep (STA's Triton route, TMA variant); SVG2 with the fused k-means assignment as default, plus a profile.
#   C  no carry: GPU tests of the new TMA defaults (extend, block-sparse, sparse backends, prefill graphs); a second
#      extend sweep (warp specialization, launches around the best).
#   D  no carry: VSA / VMoBA / SVG2 with the new defaults (+ SVG2 profile); STA's Triton route against cuDNN.
#   E  no carry: SVG2's row-gather and atomic-free k-means update kernels: GPU tests, then the SVG2 bench + profile.
#   F  no carry: VMoBA's 64-token blocks for 96-token chunks (tiny-shapes GPU check, tests, bench); extend sweep 3.
#   fa4 three calls, carries [".whl/fa/c1"], [".whl/fa/c2_ab"], [".whl/fa/c2_ac"] (FA4 + diffusers on one machine), then
#   G  tiny-shapes GPU test for vmoba and SVG2; one Wan2.1-1.3B step with each sparse backend (bench_sparse_video.py).
#   H  no carry: paged decode (bf16, fp8 per-layer, fp8 per-token) with K/V by TMA against the default, pages 64/128.
#   I  no carry: VSA at 18x48x80 (issue 11's canvas) and 21x30x52, whole call profiled.
#   J  no carry: the block-means pooling kernel and VSA's unsorted top-k: GPU tests; VSA and VMoBA at both canvases.
#   K  no carry: overlap scheduling on/off under torch.profiler (benchmarks/profile_overlap.py), embedded and 1B.
set -u
PART=${1:-help}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device_$PART.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/device_$PART.txt" 2>&1

case $PART in
A)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl > "$OUT/pip.txt" 2>&1
  export PYTHONPATH=src:/tmp/site
  timeout 150 python3 -m pytest -q -x tests/gpu/test_cuda_graph_gpu.py > "$OUT/tests_cuda_graph.txt" 2>&1
  echo "cuda graph tests rc=$?: $(tail -1 "$OUT/tests_cuda_graph.txt")"
  timeout 200 python3 -m pytest -q tests/gpu/test_flashinfer_gpu.py -k "cuda_graph or engine" \
    > "$OUT/tests_flashinfer_graph_engine.txt" 2>&1
  echo "flashinfer graph+engine tests rc=$?: $(tail -1 "$OUT/tests_flashinfer_graph_engine.txt")"
  OB="--model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --batch-size 1,64 --input-len 512 --output-len 32"
  declare -A CFG=([t128]="--attention-backend triton --page-size 128"
    [fi128]="--prefill-attention-backend triton --decode-attention-backend flashinfer --page-size 128")
  for round in a b; do
    for c in t128 fi128; do
      # shellcheck disable=SC2086
      timeout 110 python3 -m sglx bench one-batch $OB ${CFG[$c]} --output "$OUT/ob_${c}_$round.json" \
        > "$OUT/ob_${c}_$round.txt" 2>&1
      python3 -c "
import json
for r in json.load(open('$OUT/ob_${c}_$round.json'))['results']:
    print('$c $round bs', r['batch_size'], 'decode', round(r['decode_step_ms_median'], 3), 'device',
          r.get('decode_step_device_ms_median'), 'prefill', round(r['prefill_ms'], 2), 'floor', round(r['floor_ms'], 3))
" || { echo "$c $round failed"; tail -5 "$OUT/ob_${c}_$round.txt"; }
    done
  done
  ;;
B)
  export PYTHONPATH=src
  timeout 330 python3 benchmarks/sweep_extend_prefill.py --out "$OUT/sweep_extend.json" --budget-s 300 \
    > "$OUT/sweep_extend.txt" 2>&1
  echo "extend sweep rc=$?"; cat "$OUT/sweep_extend.txt" | tail -40
  timeout 130 python3 benchmarks/sweep_block_sparse.py --out "$OUT/sweep_block_sparse.json" \
    > "$OUT/sweep_block_sparse.txt" 2>&1
  echo "block-sparse sweep rc=$?"; tail -30 "$OUT/sweep_block_sparse.txt"
  timeout 120 python3 benchmarks/bench_sparse_backends.py --only svg2 --profile 3 --out "$OUT/svg2.json" \
    > "$OUT/svg2.txt" 2>&1
  echo "svg2 rc=$?"; tail -8 "$OUT/svg2.txt"
  ;;
C)
  export PYTHONPATH=src
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_triton_gpu.py -k "extend" > "$OUT/tests_extend.txt" 2>&1
  echo "extend GPU tests rc=$?: $(tail -1 "$OUT/tests_extend.txt")"
  timeout 120 python3 -m pytest -q -m gpu tests/test_block_sparse_attention.py tests/test_sparse_backends.py \
    tests/test_sliding_tile.py -k "not fa4" > "$OUT/tests_sparse.txt" 2>&1
  echo "sparse GPU tests rc=$?: $(tail -1 "$OUT/tests_sparse.txt")"
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py -k "prefill" > "$OUT/tests_prefill_graph.txt" 2>&1
  echo "prefill graph GPU tests rc=$?: $(tail -1 "$OUT/tests_prefill_graph.txt")"
  timeout 200 python3 benchmarks/sweep_extend_prefill.py --out "$OUT/sweep_extend2.json" --budget-s 170 \
    > "$OUT/sweep_extend2.txt" 2>&1
  echo "extend sweep 2 rc=$?"; grep -v "^  (" "$OUT/sweep_extend2.txt" | head; grep "^  (" "$OUT/sweep_extend2.txt" | cut -c1-150
  ;;
D)
  export PYTHONPATH=src
  timeout 200 python3 benchmarks/bench_sparse_backends.py --profile 3 --out "$OUT/sparse_backends.json" \
    > "$OUT/sparse_backends.txt" 2>&1
  echo "sparse backends rc=$?"; tail -16 "$OUT/sparse_backends.txt"
  timeout 240 python3 benchmarks/bench_sparse_video.py --out "$OUT/sta.json" --no-sweep --no-step \
    --cases "3x3x3 (85%),hunyuan,wan1.3b-480p 3x3x3" > "$OUT/sta.txt" 2>&1
  echo "sta rc=$?"; python3 -c "
import json
for c in json.load(open('$OUT/sta.json'))['cases']:
    r = c.get('routes', {}).get('triton', {})
    print(c['case'], 'cuDNN', c.get('dense', {}).get('dense cuDNN SDPA'), 'triton', r.get('ms'), 'x', r.get('x_cudnn'),
          'with reorder x', r.get('x_cudnn_with_reorder'), 'step-order x', r.get('x_cudnn_with_step_reorder'),
          'err', r.get('rel_err_vs_f64'), c.get('error', ''))
"
  ;;
E)
  export PYTHONPATH=src
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kmeans_assign_gpu.py tests/test_sparse_backends.py \
    tests/test_block_sparse_attention.py -k "not fa4" > "$OUT/tests_svg2.txt" 2>&1
  echo "kmeans + sparse GPU tests rc=$?: $(tail -1 "$OUT/tests_svg2.txt")"
  timeout 150 python3 benchmarks/bench_sparse_backends.py --only svg2 --profile 3 --out "$OUT/svg2_e.json" \
    > "$OUT/svg2_e.txt" 2>&1
  echo "svg2 rc=$?"; tail -6 "$OUT/svg2_e.txt"
  ;;
F)
  export PYTHONPATH=src
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_tiny_shapes_gpu.py -k vmoba > "$OUT/tests_tiny_vmoba.txt" 2>&1
  echo "tiny-shapes vmoba GPU test rc=$?: $(tail -1 "$OUT/tests_tiny_vmoba.txt")"
  timeout 100 python3 -m pytest -q -m gpu tests/test_sparse_backends.py -k "vmoba and not fa4" \
    > "$OUT/tests_vmoba.txt" 2>&1
  echo "vmoba GPU tests rc=$?: $(tail -1 "$OUT/tests_vmoba.txt")"
  timeout 120 python3 benchmarks/bench_sparse_backends.py --only vmoba --out "$OUT/vmoba_f.json" > "$OUT/vmoba_f.txt" 2>&1
  echo "vmoba rc=$?"; tail -9 "$OUT/vmoba_f.txt"
  timeout 200 python3 benchmarks/sweep_extend_prefill.py --out "$OUT/sweep_extend3.json" --budget-s 170 \
    > "$OUT/sweep_extend3.txt" 2>&1
  echo "extend sweep 3 rc=$?"; grep -v "^  (" "$OUT/sweep_extend3.txt" | head -5; grep "^  (" "$OUT/sweep_extend3.txt" | cut -c1-150
  ;;
H)  # paged decode with K/V by TMA (DecodeConfig.tma; pages of whole 64-key tiles) against the default, B64 ctx 4096
  export PYTHONPATH=src
  timeout 300 python3 benchmarks/bench_fp8_kv_decode.py --output "$OUT/decode_tma.json" --pages 64,128 --tma --no-store \
    > "$OUT/decode_tma.txt" 2>&1
  echo "decode tma rc=$?"; tail -30 "$OUT/decode_tma.txt"
  ;;
I)  # VSA on issue 11's own canvas (18x48x80) and on Wan 480p, with a profile of the whole call
  export PYTHONPATH=src
  for g in 18x48x80 21x30x52; do
    timeout 120 python3 benchmarks/bench_sparse_backends.py --only vsa --grid $g --profile 3 --out "$OUT/vsa_$g.json" \
      > "$OUT/vsa_$g.txt" 2>&1
    echo "vsa $g rc=$?"; tail -4 "$OUT/vsa_$g.txt"
  done
  ;;
J)  # VSA / VMoBA pooling kernel and VSA's unsorted top-k: GPU tests, then the benches of stage I and VMoBA
  export PYTHONPATH=src
  timeout 120 python3 -m pytest -q -m gpu tests/test_sparse_backends.py tests/test_block_sparse_attention.py \
    tests/gpu/test_kmeans_assign_gpu.py -k "not fa4" > "$OUT/tests_j.txt" 2>&1
  echo "sparse GPU tests rc=$?: $(tail -1 "$OUT/tests_j.txt")"
  for g in 18x48x80 21x30x52; do
    timeout 120 python3 benchmarks/bench_sparse_backends.py --only vsa --only vmoba --grid $g --out "$OUT/vsa_vmoba_$g.json" \
      > "$OUT/vsa_vmoba_$g.txt" 2>&1
    echo "vsa+vmoba $g rc=$?"; tail -9 "$OUT/vsa_vmoba_$g.txt"
  done
  ;;
K)  # overlap scheduling on vs off under torch.profiler: the host's waits on the GPU per setting
  export PYTHONPATH=src
  timeout 150 python3 benchmarks/profile_overlap.py --output "$OUT/overlap_embedded.json" > "$OUT/overlap_embedded.txt" 2>&1
  echo "embedded rc=$?"; grep -v "^USDT\|profiler_st" "$OUT/overlap_embedded.txt" | tail -8 | cut -c1-700
  timeout 200 python3 benchmarks/profile_overlap.py --model-path llama-3.2-1b --dtype bfloat16 \
    --output "$OUT/overlap_llama1b.json" > "$OUT/overlap_llama1b.txt" 2>&1
  echo "llama-3.2-1b rc=$?"; grep -v "^USDT\|profiler_st" "$OUT/overlap_llama1b.txt" | tail -8 | cut -c1-700
  ;;
fa4)  # one of FA4's three carries (.whl/fa/c1, c2_ab, c2_ac; any order, one warm machine): stash it, set up once all are here
  mkdir -p /tmp/parts
  for d in .whl/fa/c2_ab .whl/fa/c2_ac; do [ -d "$d" ] && cp -n "$d"/cu13.part_* /tmp/parts/ 2>/dev/null; done
  FA4_PIP_LOG=/tmp/pip_fa4.txt . benchmarks/device_fa4_setup.sh > /tmp/fa4_setup.txt 2>&1
  echo "cu13 parts here: $(ls /tmp/parts | tr '\n' ' ')"; tail -2 /tmp/fa4_setup.txt
  ;;
G)  # after the three fa4 calls: tiny-shapes on the GPU for VMoBA (64-token blocks) and SVG2 (row gather, segment
    # update), then one dummy Wan2.1-1.3B step with each sparse backend next to diffusers and dense FA4
  export PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
  python3 -c "import flash_attn.cute, diffusers; print('fa4 + diffusers importable')" 2>&1 | tail -1
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_tiny_shapes_gpu.py -k "vmoba or sparse_video" \
    > "$OUT/tests_tiny_sparse.txt" 2>&1
  echo "tiny-shapes vmoba + svg2 GPU rc=$?: $(tail -1 "$OUT/tests_tiny_sparse.txt")"
  timeout 300 python3 benchmarks/bench_sparse_video.py --out "$OUT/sparse_step.json" --no-sweep --no-step --sparse-step \
    --cases none > "$OUT/sparse_step.txt" 2>&1
  echo "sparse step rc=$?"; python3 -c "
import json
r = json.load(open('$OUT/sparse_step.json')).get('sparse_step', {})
for k, v in r.get('rows', {}).items(): print(k, v)
print('density', r.get('density')); print(r.get('error', ''))
"
  ;;
*)
  sed -n 2,9p "$0"
  ;;
esac
