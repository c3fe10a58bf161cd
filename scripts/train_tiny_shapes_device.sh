#!/usr/bin/env bash
# One lent-GPU call that trained the shipped tiny-shapes weights (run 4 in the model README): resume from
# the embedded model, deepen its DiT from 6 to 8 blocks (new blocks start as the identity), train DiT +
# text encoder for DIT_SECONDS at batch 512, pack the model into $OUT, then judge it on the GPU with the
# pixel checker. Carry .whl/shapes (the diffusers wheel). Checkpoints land in $OUT/ckpt.tar as it trains.
# SITE: where diffusers goes (its own folder when another job shares the machine); LOGDIR: train.log/eval.log
# (default $OUT); EVAL=0 skips the GPU judgement; TRAIN_ARGS: more train_tiny_shapes.py flags (later ones win).
set -o pipefail
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=src:$SITE
OUT=${OUT:-/tmp/out}
LOGDIR=${LOGDIR:-$OUT}
DIT_SECONDS=${DIT_SECONDS:-390}
mkdir -p "$OUT" "$LOGDIR"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    .whl/shapes/diffusers-0.42.1-py3-none-any.whl || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
python3 scripts/train_tiny_shapes.py --device cuda --resume src/sglx/diffusion/embedded/tiny-shapes \
    --out /tmp/tiny-shapes --grow-layers 8 --batch 512 --dit-lr 6e-4 --dit-seconds "$DIT_SECONDS" \
    --dit-steps 100000 --clips 16384 --encode-batch 512 --image-every 8 --log-every 50 \
    --checkpoint-dir /tmp/ckpt/tiny-shapes --checkpoint-tar "$OUT/ckpt.tar" --checkpoint-seconds 90 ${TRAIN_ARGS:-} 2>&1 \
    | grep -v "Writing model shards\|Loading weights" | tee "$LOGDIR/train.log" || exit 1
tar -C /tmp -cf "$OUT/model.tar" tiny-shapes && rm -f "$OUT/ckpt.tar"
echo "train+pack done at ${SECONDS}s"
[ "${EVAL:-1}" = 0 ] && exit 0
timeout 120 python3 scripts/eval_tiny_shapes.py --model-path /tmp/tiny-shapes --device cuda \
    --json "$LOGDIR/eval_gpu.json" 2>&1 | grep -v "Loading weights" | tee "$LOGDIR/eval.log"
if [ "$SECONDS" -lt 480 ]; then
    timeout $((575 - SECONDS)) python3 scripts/eval_tiny_shapes.py --model-path /tmp/tiny-shapes --device cuda \
        --guidance 3,5 2>&1 | grep -v "Loading weights" | tee -a "$LOGDIR/eval.log"
fi
echo "--- summary (${SECONDS}s)"
grep -E "parameters|blocks|encoded|time limit|saved" "$LOGDIR/train.log"
tail -n 3 "$LOGDIR/train.log" | head -n 1
cat "$LOGDIR/eval.log"
