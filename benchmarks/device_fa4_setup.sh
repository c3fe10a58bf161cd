# Sourced (not run) by the device scripts: FlashAttention 4 into /tmp/site from the carried .whl/fa/c* folders
# (shared DEVICE.md; c1 holds the wheels). Idempotent over consecutive calls of a warm machine: the cu13 parts
# collect in /tmp/parts, pip runs once, and the CuTe DSL cu13 tar is unpacked once all parts (cu13.nparts) are there, AFTER pip
# (pip --target replaces the whole nvidia_cutlass_dsl folder). Sets PYTHONPATH to src and /tmp/site.
# FA4_PIP_LOG: where pip's output goes (default /dev/null).
mkdir -p /tmp/parts /tmp/site
for d in .whl/fa/c*; do
  [ -d "$d" ] && cp -n "$d"/cu13.part_* "$d"/cu13.nparts /tmp/parts/ 2>/dev/null
done
NPARTS=$(cat /tmp/parts/cu13.nparts 2>/dev/null || echo 3)  # cu13.nparts travels with every part (default 3)
if [ -d .whl/fa/c1 ] && [ ! -d /tmp/site/flash_attn/cute ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fa/c1/*.whl \
    > "${FA4_PIP_LOG:-/dev/null}" 2>&1
  echo "FA4 pip rc=$?"
fi
if [ ! -f /tmp/site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so ] \
    && [ "$(ls /tmp/parts/cu13.part_* 2>/dev/null | wc -l)" = "$NPARTS" ]; then
  cat /tmp/parts/cu13.part_* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
  echo "cu13 unpack rc=$?"
fi
export PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
