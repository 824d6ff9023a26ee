#!/usr/bin/env bash
# There: issue 29 item 6 on a GPU. The service at 1, 8 and 32 streams, plain decode, then EAGLE-3
# (the shipped head, chain of 4) with spec.disable_above_batch_size = "auto" (the default: a
# fixed limit on a GPU, GPU_AUTO_LIMIT in gpu/eagle/spec_gate.py), both with CUDA graphs on.
# "auto" must draft at one stream and keep 8 and 32 streams at the plain service's speed: above
# its limit requests run headless, as the plain step. Then the same limit fixed at 2, where the
# head follows every plain step (as "auto" did before 2026-11-30): the A/B of the two.
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
common=(--device cuda --dtype bf16 --concurrency 1,8,32 --requests-per-level 32
        --max-new-tokens 64 --poisson-requests 0 --overlap on)
step gate_plain 150 python3 -m fmserve.cli bench serve "${common[@]}" \
    --markdown "$OUT/gate_plain.md"
step gate_chain 150 python3 -m fmserve.cli bench serve "${common[@]}" \
    --set spec.algorithm=eagle3 --set spec.num_steps=4 --set spec.topk=1 \
    --set spec.num_draft_tokens=5 --markdown "$OUT/gate_chain.md"
step gate_chain_follow 150 python3 -m fmserve.cli bench serve "${common[@]}" \
    --set spec.algorithm=eagle3 --set spec.num_steps=4 --set spec.topk=1 \
    --set spec.num_draft_tokens=5 --set spec.disable_above_batch_size=2 \
    --markdown "$OUT/gate_chain_follow.md"
