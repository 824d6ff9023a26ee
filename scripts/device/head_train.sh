#!/usr/bin/env bash
# There, after head_data.sh: train from scratch on all of it, evaluate on dev through the real
# spec path, and bring the head back as $OUT/head.tar (config.json, model.safetensors,
# training.json; copy it into fmserve/heads/ only if dev says it is better).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
W=/root/head-data
TE="python3 -m fmserve.cli train-eagle --device cuda --no-progress"
step train 420 $TE --work-dir $W/user --stage train --extra-data $W/t0/data --epochs 20 \
    --max-minutes 6 --max-batch-tokens 16384 --prompt-loss-weight 0.5 --no-vocab-prior \
    --val-sequences 64 --save-every 200 --log-every 50 --out /root/head
step eval 150 $TE --stage eval --eval-mode both --eval-num-prompts 32 \
    --eval-max-new-tokens 96 --out /root/head
tar -C /root -cf "$OUT/head.tar" head
