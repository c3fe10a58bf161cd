#!/usr/bin/env bash
# GPU evidence for issue 15 item 1 (tensor-parallel LLMs) in one call on a lent 2-GPU machine (nvidia-h200-x2):
# the -m gpu TP tests (NCCL group facts, logits tp2 == tp1 on torch_native and triton, engine greedy == HF with and
# without CUDA graphs, a dying rank), then `sglx bench one-batch` on the dummy Llama-3.1-8B shape at TP1 and TP2,
# batch sizes 1 and 64, both in the same run (target: TP2 decode step <= 0.60x of TP1's). NVLink multicast stays
# off (sglx forces NCCL_NVLS_ENABLE=0; exported here too). No extra wheels are needed.
# Stage dp (issue 15 item 3): `sglx serve --dp-size 1` vs `--dp-size 2` (one GPU per replica) under the same
# `sglx bench serving` load (token-id prompts, dummy Llama-3.1-8B), target: DP2 output throughput >= 1.8x.
# Usage: OUT=dir bash benchmarks/run_tp_device.sh      (STAGES="tests bench dp" picks sections)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src:tests NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-"tests bench dp"}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
'.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())" 2>&1 | tee "$OUT/versions.txt"
if has tests; then
  echo "== TP GPU tests"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py -q -p no:cacheprovider \
    > "$OUT/tp_tests.log" 2>&1
  tail -3 "$OUT/tp_tests.log"
fi
if has bench; then
  for tp in 1 2; do
    echo "== bench one-batch llama-3.1-8b dummy bf16, tp $tp"
    timeout "${BENCH_TIMEOUT:-150}" python3 -m sglx bench one-batch --model-path llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --tp-size "$tp" --batch-size 1 --batch-size 64 --input-len 1024 --output-len 32 --json \
      --output "$OUT/one_batch_tp$tp.json" > "$OUT/one_batch_tp$tp.log" 2>&1 || tail -5 "$OUT/one_batch_tp$tp.log"
  done
  python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {tp: json.loads((out / f"one_batch_tp{tp}.json").read_text()) for tp in (1, 2)
        if (out / f"one_batch_tp{tp}.json").is_file()}
print("tp  bs  decode_ms  prefill_ms  backend  graphs")
for tp, run in runs.items():
    for r in run["results"]:
        print(f"{tp:<3} {r['batch_size']:<3} {r['decode_step_ms_median']:9.3f}  {r['prefill_ms']:10.2f}  "
              f"{run['decode_attention_backend']}  {run['cuda_graph']}")
if len(runs) == 2:
    for a, b in zip(runs[1]["results"], runs[2]["results"]):
        ratio = b["decode_step_ms_median"] / a["decode_step_ms_median"]
        print(f"bs {a['batch_size']}: TP2/TP1 decode step = {ratio:.3f} (target <= 0.60)")  # dummy shards differ
EOF
fi
if has dp; then
  for dp in 1 2; do
    echo "== serve --dp-size $dp (llama-3.1-8b dummy bf16) + bench serving"
    port=$((31000 + dp))
    python3 -m sglx serve --model-path llama-3.1-8b --load-format dummy --dtype bfloat16 --dp-size "$dp" \
      --port "$port" --max-running-requests 256 > "$OUT/serve_dp$dp.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 "$pid" 2> /dev/null || break
      sleep 1
    done
    timeout "${SERVE_BENCH_TIMEOUT:-150}" python3 -m sglx bench serving --base-url "http://127.0.0.1:$port" \
      --num-prompts 512 --max-concurrency 256 --random-input-len 512 --random-output-len 128 \
      --prompt-kind token-ids --disable-progress --output-file "$OUT/serving_dp$dp.json" \
      > "$OUT/serving_dp$dp.log" 2>&1 || tail -5 "$OUT/serving_dp$dp.log"
    kill -TERM "$pid"; wait "$pid"
  done
  python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {dp: json.loads((out / f"serving_dp{dp}.json").read_text()) for dp in (1, 2)
        if (out / f"serving_dp{dp}.json").is_file()}
for dp, r in runs.items():
    print(f"dp {dp}: output {r['output_token_throughput']:.1f} tok/s, requests {r['request_throughput']:.2f}/s")
if len(runs) == 2:
    ratio = runs[2]["output_token_throughput"] / runs[1]["output_token_throughput"]
    print(f"DP2/DP1 output throughput = {ratio:.2f} (target >= 1.8)")
EOF
fi
