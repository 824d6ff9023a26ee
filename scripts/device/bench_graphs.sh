#!/usr/bin/env bash
# There: decode CUDA graphs (runtime.cuda_graph_max_batch), measured two ways in one call:
#   1. offline, graphs off and on interleaved per batch size (one loaded engine, one baseline);
#   2. the service at 32 streams with graphs on: overlap off, and on with each launch-ahead mode
#      (issue 4's idle share; compare with bench_overlap.sh's rows, which run without graphs).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
step graphs_offline 180 python3 -m fmserve.cli bench offline --device cuda --dtypes bf16 \
    --attention-backend triton --batch-sizes 1,8,32 --no-baseline --overlap off,on \
    --cuda-graphs off,on --markdown "$OUT/graphs_offline.md"
step graphs_serve 400 python3 -m fmserve.cli bench serve --device cuda --dtype bf16 \
    --attention-backend triton --set runtime.attention_backend=triton \
    --set runtime.cuda_graph_max_batch=64 --concurrency 32 --requests-per-level 96 \
    --max-new-tokens 64 --poisson-requests 0 --overlap on,off --launch-ahead off,prepare,on \
    --markdown "$OUT/graphs_serve.md"
