#!/usr/bin/env bash
# There: issue 4's GPU row and issue 29's idle target in one run, so every figure shares one
# baseline (the host side of these machines drifts between runs): overlap off, and overlap on
# with each launch-ahead mode, at 1, 8 and 32 streams. "prepare" (the GPU's "auto") leaves the
# device idle while the worker sends step k's result before launching k+1; "on" launches k+1
# first. Which one idles the device less may differ by batch size: the table says, with the
# service's CPU time a step beside it (scripts/device/README.md).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
step bench_overlap 540 python3 -m fmserve.cli bench serve --device cuda --dtype bf16 \
    --attention-backend triton --set runtime.attention_backend=triton --concurrency 1,8,32 \
    --requests-per-level 64 --max-new-tokens 64 --poisson-requests 0 --overlap on,off \
    --launch-ahead off,prepare,on --markdown "$OUT/bench_overlap.md"
