#!/usr/bin/env bash
# GPU evidence for issue 15 item 2 (sequence-parallel DiT attention) in one call on a lent 2-GPU machine
# (nvidia-h200-x2): the -m gpu SP tests (Ulysses/ring on NCCL fp32 and bf16 vs float64, sparse backends under
# Ulysses == SP 1, tiny Wan/FLUX SP 2 == SP 1, more ranks than GPUs), then bench_sequence_parallel.py at the
# Wan2.1-14B shape (75,600 tokens, 40 heads of 128, bf16): attention SP 1 vs Ulysses 2 and ring 2 (target <= 0.55x)
# and one dummy-weight 14B DiT forward, CFG batch 2 (target <= 0.6x). diffusers must be importable: install
# .whl/shapes/diffusers-*.whl (carry it) with pip --target /tmp/site. NVLink multicast stays off.
# Usage: OUT=dir bash benchmarks/run_sp_device.sh      (STAGES="tests bench" picks sections; BACKEND=fa)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/shapes/diffusers-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/shapes/diffusers-*.whl
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=src:tests:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-"tests bench"}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
'.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())" 2>&1 | tee "$OUT/versions.txt"
if has tests; then
  echo "== SP GPU tests"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu tests/gpu/test_sequence_parallel_gpu.py -q -p no:cacheprovider \
    > "$OUT/sp_tests.log" 2>&1
  tail -3 "$OUT/sp_tests.log"
fi
if has bench; then
  echo "== bench_sequence_parallel (Wan2.1-14B shape, ${BACKEND:-torch_sdpa})"
  timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_sequence_parallel.py --world 2 --step \
    --backend "${BACKEND:-torch_sdpa}" --out "$OUT/sp_bench.json" > "$OUT/sp_bench.log" 2>&1
  echo "bench rc=$?"
  tail -40 "$OUT/sp_bench.log"
fi
