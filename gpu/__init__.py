"""fmserve worker process: model, KV cache, attention backends, sampler, FutureMap, EAGLE."""
