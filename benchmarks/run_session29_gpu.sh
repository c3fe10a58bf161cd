#!/usr/bin/env bash
# Session 29 on the lent GPU: stages named on the command line run in order; every log and JSON lands in $OUT.
#   fi       FlashInfer (+ xdist) into /tmp/site from the carried .whl/fi and .whl/xdist (idempotent)
#   fa4      FA4 from the carried .whl/fa/c* (benchmarks/device_fa4_setup.sh; the cu13 parts collect over calls)
#   mla      tests/gpu/test_mla_gpu.py -k "$MLA_K" (default "576_latent or align or fused_moe": the hybrid flashinfer-prefill +
#            triton-decode MLA pair, moe_align_by_sort against the kernel, fused MoE)
#   align    moe_align: the one-program kernel against moe_align_by_sort at 1k-256k pairs (graph-free timing), then
#            DeepSeek-V2-Lite one-batch at batch 64 with the shipped threshold and with the kernel everywhere
#            (session 29's code: moe_align_by_sort and ALIGN_KERNEL_MAX_PAIRS left in session 30, so this stage runs
#            only on a checkout of 207ad53; session 30's `align` stage is benchmarks/bench_moe_align.py)
#            ($ALIGN_REPS rounds, default 2; 0 for the microbenchmark alone)
#   diffusers  diffusers (carried .whl/diffusers) into /tmp/site
#   planning VSA's planning pieces: the block-means kernel over launch shapes, torch.topk + sort against the top-k kernel
#   step     one dummy Wan2.1-1.3B 480p step with each sparse backend next to diffusers (bench_sparse_video.py)
#   vsaprof  VSA's whole call at 18x48x80 with tokens kept in cube order, profiled (top GPU kernels, host ops)
#   sparse_tests  block-sparse GPU tests: Triton kernel and FA4 route against float64, sparse backends
#   vsa      bench_sparse_backends.py --only vsa on 18x48x80 and 21x30x52 ($ROUTES, default "default")
#   sparse   bench_sparse_backends.py (VSA, VMoBA, SVG2) on 21x30x52 for each of $ROUTES
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=160 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
SITE=/tmp/site; mkdir -p $SITE
export PYTHONPATH=$PWD/src:$PWD/tests:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    fi)
      [ -d $SITE/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE \
        .whl/fi/*.whl .whl/xdist/*.whl > "$OUT/pip_fi.log" 2>&1; echo "fi rc=$?" ;;
    fa4)
      FA4_PIP_LOG=$OUT/pip_fa4.log source benchmarks/device_fa4_setup.sh
      export PYTHONPATH=$PWD/src:$PWD/tests:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
      ls /tmp/parts; python3 -c "import flash_attn.cute as c; print('fa4 ok', c.__file__)" 2>&1 | tail -1 ;;
    mla)
      timeout ${MLA_S:-400} python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -p xdist tests/gpu/test_mla_gpu.py \
        -k "${MLA_K:-576_latent or align or fused_moe}" 2>&1 | tee "$OUT/mla_tests.txt" | tail -15 ;;
    align)
      timeout 200 python3 - <<'PY' 2>&1 | tee "$OUT/moe_align_micro.txt"
import json, os, torch, triton.testing as tt
from sglx.llm.kernels import fused_moe as fm
rows = []
fm.ALIGN_KERNEL_MAX_PAIRS = 1 << 40
for experts, shared in ((64, 0), (66, 2)):  # top-6 of 64; DeepSeek-V2-Lite: top-6 of 64 routed + 2 shared
    for tokens in (128, 256, 512, 683, 1024, 1536, 2048, 4096, 16384, 32768):
        routed = torch.rand(tokens, 64, device="cuda").topk(6, dim=1).indices
        ids = torch.cat([routed, torch.arange(64, experts, device="cuda").expand(tokens, shared)], 1).to(torch.int32)
        block_m = fm.moe_block_m(ids.numel())
        k = tt.do_bench(lambda: fm.moe_align(ids, experts, block_m), warmup=20, rep=100)
        s = tt.do_bench(lambda: fm.moe_align_by_sort(ids, experts, block_m), warmup=20, rep=100)
        rows.append({"experts": experts, "tokens": tokens, "pairs": ids.numel(), "block_m": block_m,
                     "kernel_ms": round(k, 4), "sort_ms": round(s, 4)})
        print(rows[-1], flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
          open(os.environ["OUT"] + "/moe_align_micro.json", "w"), indent=1)
PY
      for rep in $(seq 1 ${ALIGN_REPS:-2}); do
        for mode in shipped kernel; do
          echo "--- round $rep $mode $(date +%T)"
          MAXP=4096; [ $mode = kernel ] && MAXP=1099511627776
          timeout 240 python3 -c "
import sys
from sglx.llm.kernels import fused_moe
fused_moe.ALIGN_KERNEL_MAX_PAIRS = $MAXP
from sglx.cli.app import main
sys.argv = ['sglx'] + sys.argv[1:]
main()" bench one-batch --model-path deepseek-v2-lite --load-format dummy --dtype bfloat16 \
            --attention-backend triton --batch-size 64 --input-len 512 --output-len 8 --max-total-tokens 65536 \
            --no-prefill-floor --output "$OUT/one_batch_v2lite_bs64_${mode}_r$rep.json" 2>&1 | tail -4
        done
      done ;;
    sparse_tests)
      timeout ${SPT_S:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_block_sparse_routes.py \
        tests/test_block_sparse_attention.py tests/test_sparse_backends.py tests/test_sliding_tile.py 2>&1 \
        | tee "$OUT/sparse_tests.txt" | tail -15 ;;
    vsa)
      for route in ${ROUTES:-default}; do
        r=""; [ "$route" != default ] && r="--route $route"
        for grid in 18x48x80 21x30x52; do
          echo "--- vsa $grid route $route"
          timeout 240 python3 benchmarks/bench_sparse_backends.py --only vsa --grid $grid $r \
            --out "$OUT/vsa_${grid}_${route}.json" 2>&1 | tail -9
        done
      done ;;
    diffusers)
      [ -d $SITE/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE \
        .whl/diffusers/*.whl > "$OUT/pip_diffusers.log" 2>&1; echo "diffusers rc=$?" ;;
    planning)
      timeout 200 python3 benchmarks/bench_vsa_planning.py --out "$OUT/vsa_planning.json" 2>&1 | tail -30 ;;
    step)
      timeout ${STEP_S:-360} python3 benchmarks/bench_sparse_video.py --out "$OUT/sparse_step.json" --no-sweep --no-step \
        --sparse-step --cases none > "$OUT/sparse_step.txt" 2>&1; echo "step rc=$?"
      python3 -c "
import json
r = json.load(open('$OUT/sparse_step.json')).get('sparse_step', {})
for k, v in r.get('rows', {}).items(): print(k, v, r.get('over_diffusers', {}).get(k), r.get('density', {}).get(k))
" ;;
    vsaprof)
      timeout 200 python3 benchmarks/bench_sparse_backends.py --only vsa --grid 18x48x80 --profile 10 \
        --out "$OUT/vsa_18x48x80_profile.json" 2>&1 | tail -12 ;;
    sparse)
      for route in ${ROUTES:-default}; do
        r=""; [ "$route" != default ] && r="--route $route"
        echo "--- sparse 21x30x52 route $route"
        timeout 300 python3 benchmarks/bench_sparse_backends.py $r --out "$OUT/sparse_21x30x52_${route}.json" 2>&1 | tail -16
      done ;;
  esac
done
echo "=== done $(date +%T)"
