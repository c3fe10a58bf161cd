#!/usr/bin/env bash
# GPU evidence for issue 14 (MLA) in one call on the lent machine: the triton MLA decode kernel vs FlashInfer MLA
# at DeepSeek-V3's attention shape (each checked vs float64 first; a small sweep of the triton launch configs),
# the MLA -m gpu tests (flashinfer MLA included), the DeepSeek-V2-Lite MoE layer and decode step (fused Triton MoE
# vs torch's grouped GEMM vs the loop; one-batch with a kernel profile), and `sglx bench one-batch` on the dummy
# DeepSeek-V2-Lite. FlashInfer comes from wheels (see /work/shared/DEVICE.md) installed into /tmp/site.
# Usage: OUT=dir WHEELS=.whl/fi bash benchmarks/run_mla_device.sh
#   STAGES="bench tests step onebatch" picks sections; CONFIGS='[{"block_h": 64, ...}]' sets the sweep.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 FLASHINFER_CUDA_ARCH_LIST=9.0a
STAGES=${STAGES:-"bench fp8 tests step onebatch"}
WHEELS=${WHEELS:-.whl/fi}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
export PYTHONPATH=src:/tmp/site
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, \
'flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee "$OUT/versions.txt"
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
# compiled for sm_90 with triton 3.6 on the CPU box: block_h 64 with 8 warps runs wgmma with no spills at
# block_n 16/32 (and 64 at 2 stages); block_h 128 does not compile (128 registers a thread at 16 warps)
DEFAULT_CONFIGS='[{"block_n": 64}, {"block_h": 32, "block_n": 64, "num_warps": 8, "waves": 2},
 {"block_h": 64, "num_warps": 8, "waves": 1}, {"block_h": 64, "num_warps": 8, "waves": 2},
 {"block_h": 64, "num_warps": 8, "min_chunk": 4096}, {"block_h": 64, "num_warps": 8, "num_stages": 3, "waves": 1},
 {"block_h": 64, "num_warps": 8, "num_stages": 3, "min_chunk": 4096},
 {"block_h": 64, "block_n": 16, "num_warps": 8, "num_stages": 3, "waves": 1},
 {"block_h": 64, "block_n": 16, "num_warps": 8, "num_stages": 3, "min_chunk": 4096},
 {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "waves": 1},
 {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "min_chunk": 4096}]'
if has bench; then
  echo "== MLA decode: triton vs FlashInfer (B64 H128 512+64 ctx 4096, page 1), triton sweep"
  timeout "${BENCH_TIMEOUT:-110}" python3 benchmarks/bench_mla_decode.py --pages 1 --kv-cache-dtypes auto \
    --configs "${CONFIGS:-$DEFAULT_CONFIGS}" --out "$OUT/mla_decode.json" > "$OUT/mla_decode.log" 2>&1
  python3 - "$OUT/mla_decode.json" <<'EOF' 2>&1 | tail -25
import json, sys
for e in json.load(open(sys.argv[1]))["results"]:
    for r in e["routes"]:
        print(f"  {r.get('ms', float('nan')):8.4f} ms {r.get('gb_per_s', 0):7.0f} GB/s  "
              f"err {r.get('max_abs_error', float('nan')):.2g}  {r['route'][:150]} {r.get('error', r.get('skipped', ''))[:150]}")
    print("best triton / flashinfer:", e.get("best_triton_over_flashinfer"), e.get("best_triton_route"))
EOF
  [ -s "$OUT/mla_decode.json" ] || grep -o '"route": "[^"]*", "max_abs_error": [^,]*, [^]]*\], "ms": [0-9.]*' \
    "$OUT/mla_decode.log" | cut -c1-250
  BEST=$(python3 - "$OUT/mla_decode.json" <<'EOF' 2>/dev/null
import json, re, sys
e = json.load(open(sys.argv[1]))["results"][0]
route = e.get("best_triton_route", "")
keep = ("block_h", "block_n", "num_warps", "num_stages", "min_chunk", "waves")
fields = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", route) if k in keep}
print(json.dumps([fields]))
EOF
)
fi
if has fp8; then
  echo "== fp8 latent cache, triton (default and best bf16 config ${BEST:=[]})"
  timeout "${FP8_TIMEOUT:-40}" python3 benchmarks/bench_mla_decode.py --pages 1 --kv-cache-dtypes fp8_e4m3 \
    --configs "${BEST:-[]}" --out "$OUT/mla_decode_fp8.json" > "$OUT/mla_decode_fp8.log" 2>&1
  grep -o '"route": "[^"]*", "max_abs_error": [^,]*, [^]]*\], "ms": [0-9.]*' "$OUT/mla_decode_fp8.log" | cut -c1-250
fi
if has tests; then
  echo "== MLA gpu tests"
  timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -m gpu -v -p no:cacheprovider tests/gpu/test_mla_gpu.py \
    -k "${TESTS_K:-not dummy_deepseek}" > "$OUT/pytest_mla_gpu.log" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/pytest_mla_gpu.log" | sed 's/^tests\/gpu\/test_mla_gpu.py:://' | cut -c1-150
  grep -E "^E  " "$OUT/pytest_mla_gpu.log" | head -30 | cut -c1-300
  tail -1 "$OUT/pytest_mla_gpu.log"
fi
if has step; then
  echo "== DeepSeek-V2-Lite MoE layer and decode step profile"
  timeout "${STEP_TIMEOUT:-80}" python3 benchmarks/bench_deepseek_step.py --out "$OUT/deepseek_step.json" \
    > "$OUT/deepseek_step.log" 2>&1
  grep -v "^{" "$OUT/deepseek_step.log" | tail -50 | cut -c1-200
fi
if has onebatch; then
  echo "== sglx bench one-batch, dummy DeepSeek-V2-Lite (bf16, triton MLA, CUDA graphs)"
  timeout "${ONEBATCH_TIMEOUT:-90}" python3 -m sglx bench one-batch --model-path deepseek-v2-lite --load-format dummy \
    --dtype bfloat16 --attention-backend triton --batch-size 1,32 --input-len 512 --output-len 32 \
    --max-total-tokens 65536 --output "$OUT/one_batch_v2_lite.json" > "$OUT/one_batch.log" 2>&1
  tail -8 "$OUT/one_batch.log" | cut -c1-250
fi
