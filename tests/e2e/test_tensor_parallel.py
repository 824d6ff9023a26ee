"""`fmserve serve --tp 2` on the CPU (gloo, two real rank processes): the same greedy tokens
as one rank, with overlap on and concurrent clients, plain and under EAGLE-3; a model whose
heads tp cannot split is refused with the reason; a rank that dies takes the group down, its
request gets one error, and the service restarts the whole group."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fmserve.engine import Engine
from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from ipc.worker_config import worker_config
from service.worker_supervisor import WorkerHandle, WorkerStartError
from tests.e2e.service_process import ServiceProcess, assert_idle, child_pids
from tests.gpu import family_models as fm

PROMPTS = [[fm.BOS] + [(5 * i + 11 * j) % 300 for i in range(n)]
           for j, n in enumerate((29, 12, 20))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_new_tokens=10, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """A tiny Llama that two ranks can split: 8 heads, 4 KV heads of 32."""
    model = fm.random_model("llama", hidden_size=256, intermediate_size=384,
                            num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=8192)
    return model, fm.save_hf_dir(model, tmp_path_factory.mktemp("tp-llama"))


@pytest.fixture(scope="module")
def tp_eagle_model(tmp_path_factory):
    """A 4-layer Llama two ranks can split, and a random EAGLE-3 head for it (aux layers 0-2)."""
    import torch

    from gpu.eagle.head_io import random_draft_head, save_draft_head
    from gpu.loader.load import load_model

    model = fm.random_model("llama", hidden_size=256, intermediate_size=384,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=8192)
    path = fm.save_hf_dir(model, tmp_path_factory.mktemp("tp-eagle-llama"))
    loaded = load_model(str(path), dtype=torch.float32, progress=False)
    head = random_draft_head(loaded.config, loaded.weights["embed_tokens"], None,
                             aux_layer_ids=(0, 1, 2), seed=5)
    head_dir = tmp_path_factory.mktemp("tp-eagle-head")
    save_draft_head(head, head_dir)
    return path, head_dir


def complete_at_once(svc: ServiceProcess) -> list[list[int]]:
    """The three prompts greedy, the first seeded and the second unseeded, all at once."""
    def complete(job):
        prompt, params = job
        with Client(svc.endpoint) as client:
            return client.complete(token_ids=prompt, params=params).token_ids

    jobs = list(zip(PROMPTS + [PROMPTS[0], PROMPTS[1]], [GREEDY] * 3 + [SEEDED, UNSEEDED]))
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(complete, jobs))


def rank_pids(svc: ServiceProcess) -> list[int]:
    """Rank 0 (the service's worker) and the ranks it started."""
    rank0 = svc.worker_pid()
    return [rank0, *child_pids(rank0)]


def test_two_ranks_give_the_one_rank_tokens_through_the_service(tp_model):
    model, path = tp_model
    one_rank = Engine(model=str(path), dtype="fp32", progress=False)
    expected = [c.token_ids for c in one_rank.generate(PROMPTS + [PROMPTS[0]],
                                                       [GREEDY] * 3 + [SEEDED])]
    assert expected[:3] == [fm.reference_greedy(model, p, 10) for p in PROMPTS]
    svc = ServiceProcess(path, "--tp", "2", "--overlap")
    try:
        assert len(rank_pids(svc)) == 2

        got = complete_at_once(svc)
        assert got[:4] == expected
        # Unseeded: the ranks drew one shared seed (their same-token check would have failed
        # the step otherwise, FMSERVE_WRWR_CHECK being on under test).
        assert len(got[4]) == 10
        with Client(svc.endpoint) as client:
            assert_idle(client)
    finally:
        assert svc.stop() == 0, svc.log_text()


def test_eagle3_tree_on_two_ranks_gives_one_ranks_tokens_through_the_service(tp_eagle_model):
    path, head = tp_eagle_model
    spec = SpecSettings("eagle3", str(head), num_steps=3, topk=2, num_draft_tokens=6,
                        disable_above_batch_size=0)
    plain = Engine(model=str(path), dtype="fp32", progress=False)
    expected = [c.token_ids for c in plain.generate(PROMPTS, [GREEDY] * 3)]
    one_rank = Engine(model=str(path), dtype="fp32", progress=False, spec=spec)
    spec_runs = one_rank.generate(PROMPTS + [PROMPTS[0]], [GREEDY] * 3 + [SEEDED])
    assert [c.token_ids for c in spec_runs[:3]] == expected
    # disable_above_batch_size stays "auto": ranks that each timed themselves could part ways,
    # so under tp > 1 it always drafts, as the one rank above does with 0.
    svc = ServiceProcess(path, "--tp", "2", "--overlap", "--spec-algorithm", "eagle3",
                         "--draft-model", str(head), "--spec-topk", "2",
                         "--spec-num-draft-tokens", "6")
    try:
        got = complete_at_once(svc)
        assert got[:3] == expected
        # Seeded: speculative sampling draws the same on both ranks as on one.
        assert got[3] == spec_runs[3].token_ids
        assert len(got[4]) == 10  # unseeded: the ranks' same-draft check held every step
        with Client(svc.endpoint) as client:
            assert_idle(client)
    finally:
        assert svc.stop() == 0, svc.log_text()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_tp_that_does_not_divide_the_heads_is_refused(tiny_llama):
    handle = WorkerHandle(worker_config(model_path=str(tiny_llama), dtype="fp32", tp=2,
                                        max_kv_tokens=256, worker_cpu_threads=1),
                          ready_timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    with pytest.raises(WorkerStartError, match=r"parallel.tp = 2 must divide the model's 9 "
                                               r"attention heads"):
        await handle.start()
    assert handle.pid is None


def test_a_rank_that_dies_takes_the_group_down_and_the_service_restarts_it(tp_model):
    model, path = tp_model
    svc = ServiceProcess(path, "--tp", "2", "--max-tokens-per-step", "4096")
    try:
        with Client(svc.endpoint) as client:
            # Rank 1 killed in the middle of a long request: one error for it.
            rank0, rank1 = rank_pids(svc)
            long = SamplingParams(temperature=0.0, max_new_tokens=1800, ignore_eos=True)
            failure: list[BaseException] = []

            def run_long():
                try:
                    with Client(svc.endpoint) as c:
                        c.complete(token_ids=PROMPTS[0], params=long, timeout_s=120)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    failure.append(exc)

            thread = threading.Thread(target=run_long)
            thread.start()
            while client.health().running == 0:
                time.sleep(0.01)
            time.sleep(0.3)
            os.kill(rank1, signal.SIGKILL)
            thread.join(60)
            assert len(failure) == 1 and isinstance(failure[0], RequestFailed), failure
            assert failure[0].code == "worker_died", failure[0]

            # The whole group is replaced: a new rank 0 with a new rank 1, giving the same
            # tokens again.
            deadline = time.monotonic() + 60
            while client.health().worker_state != "ready" or len(svc.worker_pids()) != 1:
                assert time.monotonic() < deadline, client.health()
                time.sleep(0.05)
            pids = rank_pids(svc)
            assert rank0 not in pids and rank1 not in pids and len(pids) == 2
            got = client.complete(token_ids=PROMPTS[1], params=GREEDY).token_ids
            assert got == fm.reference_greedy(model, PROMPTS[1], 10)

            # Rank 1 killed while the group is idle: rank 0 notices and the group restarts.
            os.kill(pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while client.health().worker_restarts < 2 or client.health().worker_state != "ready":
                assert time.monotonic() < deadline, client.health()
                time.sleep(0.05)
            assert client.complete(token_ids=PROMPTS[1], params=GREEDY).token_ids == got
            assert_idle(client)
        # The mid-request death, however rank 0 met it (a failed collective in the forward,
        # or the relay of the next plan), names the rank.
        assert "the tensor-parallel group is down: tensor-parallel rank 1" in svc.log_text()
    finally:
        svc.stop()
