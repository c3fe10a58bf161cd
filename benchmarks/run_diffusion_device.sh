#!/usr/bin/env bash
# Diffusion evidence on the lent GPU, in one call: the FA4 / SageAttention / diffusers wheels installed
# under /tmp/site (see shared DEVICE.md; the cu13 CUTLASS libs arrive as split parts in /tmp/parts),
# then doctor --check, the GPU tests of the diffusion backends and `sglx bench diffusion`.
# Usage on the device: bash benchmarks/run_diffusion_device.sh [TAG]   (results under $OUT)
set -u
TAG=${1:-h100}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. benchmarks/device_fa4_setup.sh
python3 - <<'PY' | tee "$OUT/versions_$TAG.txt"
import importlib, torch, triton
print("gpu", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "triton", triton.__version__)
for m in ("flash_attn.cute", "sageattention", "diffusers"):
    try:
        mod = importlib.import_module(m); print(m, "ok", getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "FAILED", type(e).__name__, str(e)[:300])
PY
timeout 240 python3 -m sglx doctor --family diffusion --check > "$OUT/doctor_diffusion_check_$TAG.txt" 2>&1
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_diffusion_backends_gpu.py tests/gpu/test_dit_fused_gpu.py \
  > "$OUT/gpu_tests_diffusion_$TAG.txt" 2>&1
timeout ${BENCH_TIMEOUT:-420} python3 -m sglx bench diffusion ${BENCH_ARGS:-} --output "$OUT/bench_diffusion_$TAG.json" \
  > "$OUT/bench_diffusion_$TAG.txt" 2> "$OUT/bench_diffusion_stderr_$TAG.txt"
echo "bench rc=$?"
tail -3 "$OUT/gpu_tests_diffusion_$TAG.txt"
grep -E "^│ (fa|sage_attn|torch_sdpa) |pass|fail|broken" "$OUT/doctor_diffusion_check_$TAG.txt" | head -12
tail -5 "$OUT/bench_diffusion_stderr_$TAG.txt"
cat "$OUT/bench_diffusion_$TAG.txt"
