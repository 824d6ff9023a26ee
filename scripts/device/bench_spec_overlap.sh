#!/usr/bin/env bash
# There: the EAGLE step's launch/finish split on a GPU (issue 4 with speculation): the service
# with EAGLE-3 (the shipped head, chain of 4) at 8 streams, overlap off, and on with each
# launch-ahead mode, in one run. Before the split the EAGLE step synced inside its launch, so
# launch-ahead could not hide the host's work between two steps; now it should.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
step bench_spec_overlap 540 python3 -m fmserve.cli bench serve --device cuda --dtype bf16 \
    --attention-backend triton --set runtime.attention_backend=triton \
    --set spec.algorithm=eagle3 --set spec.num_steps=4 --set spec.topk=1 \
    --set spec.num_draft_tokens=5 --concurrency 8 --requests-per-level 48 \
    --max-new-tokens 64 --poisson-requests 0 --overlap on,off --launch-ahead off,prepare,on \
    --markdown "$OUT/bench_spec_overlap.md"
