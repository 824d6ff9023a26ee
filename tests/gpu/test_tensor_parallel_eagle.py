"""EAGLE-3 on tensor-parallel ranks (real processes over gloo, one scheduler on rank 0 whose
plans reach every rank): the shipped head for the default model, chain and tree, overlap on,
gives one rank's greedy tokens in fp32 and gets drafts accepted; in bf16 on the int4 weights
the ranks agree every step and the head drafts as well as on one rank. The default
model has 9 attention heads, so its ranks are 3 (tp = 2 cannot split them;
tests/e2e/test_tensor_parallel.py runs tp = 2 through the service on a model it can split)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from fmserve.default_model import resolve_draft_model
from fmserve.engine import Engine
from gpu.q4_linear import q4_kernel_available
from ipc.sampling import SamplingParams
from ipc.spec_settings import accept_length
from ipc.worker_config import worker_config
from tests.gpu import tp_rank_runs
from tests.gpu.spec_runs import CHAIN, QUESTIONS, TREE
from tests.ports import free_port

TP = 3
CHATS = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
GREEDY = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (12, 9, 14)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    pass


def config(model_path, spec=None, tp: int = 1, dtype: str = "fp32"):
    if spec is not None:
        spec = msgspec.structs.replace(spec, draft_model=str(resolve_draft_model(
            spec.algorithm, "", str(model_path))))
    return worker_config(model_path=str(model_path), dtype=dtype, page_size=4,
                         max_kv_tokens=1024, max_running_requests=4, max_tokens_per_step=48,
                         worker_cpu_threads=1, progress=False, spec=spec, tp=tp)


def on_ranks(tmp_path, cfgs, params) -> list[dict]:
    mp.spawn(tp_rank_runs.engine_rank_main,
             args=(TP, free_port(), cfgs, CHATS, params, True, str(tmp_path)), nprocs=TP,
             join=True)
    return torch.load(tmp_path / "runs.pt")


def test_eagle3_chain_and_tree_on_three_ranks_give_one_ranks_greedy_tokens(model_path,
                                                                           tmp_path):
    # One rank's EAGLE gives these tokens too (tests/gpu/test_spec_decode.py).
    expected = [c.token_ids for c in Engine(config=config(model_path)).generate(CHATS, GREEDY)]
    chain, tree = on_ranks(tmp_path, [config(model_path, s, TP) for s in (CHAIN, TREE)], GREEDY)
    for run in (chain, tree):
        assert run["tokens"] == expected
        assert run["verify_steps"] > 0 and run["accepted"] > 0, run


@pytest.mark.skipif(not q4_kernel_available(), reason="torch has no CPU int4 matmul")
def test_eagle3_on_three_ranks_drafts_and_verifies_on_their_int4_weights(model_path, tmp_path):
    # bf16 with the file's int4 codes kept, each rank its cut, and the head on int8 copies.
    # Greedy tokens are not the measure in bf16: the ranks round their summed partial sums
    # otherwise than one rank does, and a verify of several rows rounds otherwise than a
    # decode of one (on three ranks one prompt here parts from plain decoding at its 9th
    # token). What must hold: every rank drafts and samples the same tokens each
    # step (the same-token check is on under test), and the head, fed the ranks' captured
    # states and the vocabulary-parallel embedding, drafts as well as it does on one rank.
    (chain,) = on_ranks(tmp_path, [config(model_path, CHAIN, TP, "bf16")], GREEDY)
    assert chain["q4_projections"] == 4 * chain["num_layers"]  # none dequantized for its cut
    assert all(chain["tokens"])
    # The shipped head accepts ~1.1 drafts a step here; wrong draft inputs would accept none.
    assert accept_length(chain["accepted"], chain["verify_steps"]) >= 1.3, chain
