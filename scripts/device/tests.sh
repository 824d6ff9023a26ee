#!/usr/bin/env bash
# There: the suite's files that exercise the GPU paths, each under its own limit (one hung file
# must not cost the whole call). Logs come back in $OUT. Needs the model staged (call 3).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && source scripts/device/stage.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
T="python3 -m pytest -q --timeout 120 -p no:cacheprovider"
step kernels 240 $T tests/gpu/test_triton_attention.py tests/gpu/test_tree_attention.py \
    tests/gpu/test_torch_attention.py tests/gpu/test_future_map.py tests/gpu/test_sampler.py \
    tests/gpu/test_kv_cache.py
step cuda 240 $T tests/gpu/test_cuda.py tests/gpu/test_decode_graphs.py tests/gpu/test_overlap.py \
    tests/gpu/test_worker_process.py
step service 360 $T tests/service/test_server.py tests/gpu/test_spec_decode.py tests/gpu/test_host_sync.py \
    tests/gpu/test_eagle_graphs.py
