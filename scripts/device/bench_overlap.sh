#!/usr/bin/env bash
# There: issue 4's GPU row in one run, so every figure shares one baseline (the host side of
# these machines drifts between runs): overlap off, and overlap on with each launch-ahead mode.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
step bench_overlap 540 python3 -m fmserve.cli bench serve --device cuda --dtype bf16 \
    --attention-backend triton --set runtime.attention_backend=triton --concurrency 32 \
    --requests-per-level 96 --max-new-tokens 64 --poisson-requests 0 --overlap on,off \
    --launch-ahead off,prepare,on --markdown "$OUT/bench_overlap.md"
