#!/usr/bin/env bash
# There, after head_data.sh: train from scratch on all of it, evaluate on dev through the real
# spec path, and bring the head back as $OUT/head.tar (config.json, model.safetensors,
# training.json; copy it into fmserve/heads/ only if dev says it is better).
# HEAD_WIDTH=N trains a head whose MLP is N wide (default: the target's 1536; up to 2944 stays
# under 25 MB) and brings it back as $OUT/head-N.tar: the shipped head fits its training data
# no better than held-out data, so a wider one is the capacity experiment to run beside it.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
W=/root/head-data
NAME=head${HEAD_WIDTH:+-$HEAD_WIDTH}
# Each width trains in its own work dir (its own checkpoints), on the same data: the user-style
# shards (their tail is held out) and the T0 shards.
mkdir -p $W/$NAME && ln -sfn $W/user/data $W/$NAME/data
TE="python3 -m fmserve.cli train-eagle --device cuda --no-progress"
step train_$NAME 420 $TE --work-dir $W/$NAME --stage train --extra-data $W/t0/data \
    --epochs 20 --head-intermediate-size "${HEAD_WIDTH:-0}" --max-minutes 6 \
    --max-batch-tokens 16384 --prompt-loss-weight 0.5 --no-vocab-prior \
    --val-sequences 64 --save-every 200 --log-every 50 --out /root/$NAME
step eval_$NAME 150 $TE --stage eval --eval-mode both --eval-num-prompts 32 \
    --eval-max-new-tokens 96 --out /root/$NAME
tar -C /root -cf "$OUT/$NAME.tar" $NAME
