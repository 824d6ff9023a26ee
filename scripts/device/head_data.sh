#!/usr/bin/env bash
# There: issue 6's data for a draft head trained from scratch on the GPU: the target writes
# user-style instructions from train.jsonl's seed tasks and answers them (half sampled), and
# answers T0 prompts; the aux states are captured into shards under /root/head-data (kept
# while the machine stays warm; head_train.sh follows in the next call).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
W=/root/head-data
TE="python3 -m fmserve.cli train-eagle --device cuda --dtype bf16 --no-progress"
step prompts 150 $TE --work-dir $W/user --stage prompts --synth-prompts 6000 --seed 9
step user_data 240 $TE --work-dir $W/user --stage data --prompts $W/user/synth-prompts.jsonl \
    --num-prompts 6154 --sampled-fraction 0.5 --gen-batch-size 512 --shard-size 512
step t0_data 180 $TE --work-dir $W/t0 --stage data --num-prompts 12000 --seed 7 \
    --gen-batch-size 512 --shard-size 512
du -sh $W/*/data
