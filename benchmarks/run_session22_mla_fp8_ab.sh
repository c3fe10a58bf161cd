#!/usr/bin/env bash
# Session 22 device call: the GPU tier of MLA (tests/gpu/test_mla_gpu.py), then bench_mla_decode.py (B64 H128 ctx 4096,
# page 1, bf16 and fp8 e4m3 latents, FlashInfer MLA in the same run) on the previous tree (.old_src/src) and this one,
# alternated in fresh processes, two rounds. Needs the FlashInfer and xdist wheels in .whl/ (DEVICE.md).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl .whl/xdist/*.whl 2>&1 | tail -1
PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -p xdist tests/gpu/test_mla_gpu.py 2>&1 | tail -3
for rep in 1 2; do for tree in old new; do
  src=$PWD/src; [ $tree = old ] && src=$PWD/.old_src/src
  echo "--- $rep $tree"
  PYTHONPATH=$src:/tmp/site timeout 120 python3 benchmarks/bench_mla_decode.py --pages 1 --kv-cache-dtypes auto,fp8_e4m3 --out $OUT/mla_fp8_${tree}_r${rep}.json 2>&1 | grep -iE "ms|triton|flashinfer" | grep -v Warn | cut -c1-160 | tail -8
done; done
