"""A family beside Llama through the whole service, with overlap on: `fmserve serve` on a tiny
Qwen3, a tiny Mistral and a tiny Gemma 3 (their sliding windows shorter than the prompts), three
concurrent clients, each getting transformers' greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ipc.client import Client
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess, assert_idle
from tests.gpu import family_models as fm

PROMPTS = [[fm.BOS] + [(5 * i + 11 * j) % 300 for i in range(n)]
           for j, n in enumerate((29, 12, 20))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3"])
def test_concurrent_greedy_streams_match_transformers(tmp_path, family):
    model = fm.random_model(family)
    svc = ServiceProcess(fm.save_hf_dir(model, tmp_path), "--overlap")
    try:
        def complete(prompt):
            with Client(svc.endpoint) as client:
                return client.complete(token_ids=prompt, params=GREEDY).token_ids

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert got == [fm.reference_greedy(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
        with Client(svc.endpoint) as client:
            assert_idle(client)
    finally:
        assert svc.stop() == 0, svc.log_text()
