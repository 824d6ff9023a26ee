"""EAGLE verify with min_new_tokens and penalties: a tree node deep in the draft samples the
token that follows the drafts above it, so the eos ban and the penalty counts it sees must
include those drafts, exactly as plain decoding would have counted them by then."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fmserve.engine import Engine
from gpu.eagle.eagle_step import EagleStep
from gpu.eagle.tree import chain_tree
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.engine_runs import assert_accounting_empty

CHAIN = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4)
CHAT = [{"role": "user", "content": "Name three colors."}]


def make_engine(model_path, spec=None) -> Engine:
    return Engine(model=str(model_path), dtype="fp32", page_size=16, max_kv_tokens=2048,
                  max_running_requests=2, progress=False, spec=spec)


def test_min_new_tokens_lets_eos_through_at_the_same_token_under_speculation(model_path):
    # The answer ends with eos at token K. With min_new_tokens = K - 1 eos is allowed at token
    # K, so plain decoding still stops there. Verify used to ban eos at every node of a step
    # that started before min_new_tokens, so an eos drafted deeper in that step was rejected
    # and the request ran on to max_new_tokens.
    plain, spec = make_engine(model_path), make_engine(model_path, CHAIN)
    free = plain.generate([CHAT], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    assert free.finish_reason.value == "stop", "the scenario needs an answer that ends by eos"
    # Banning eos where it was not the argmax leaves plain greedy decoding as it was.
    params = SamplingParams(temperature=0.0, max_new_tokens=16,
                            min_new_tokens=len(free.token_ids) - 1)
    got = spec.generate([CHAT], params)[0]
    assert (got.token_ids, got.finish_reason) == (free.token_ids, free.finish_reason)
    assert got.spec_accepted_drafts > 0  # drafts were accepted: verify decided some tokens
    assert_accounting_empty(spec)


# -- verify's acceptance on hand-made logits, through the real sampler state -----------------

VOCAB, A, B, ROOT, EOS = 16, 5, 6, 7, 2


@pytest.fixture(scope="module")
def spec_runner(tiny_llama, tmp_path_factory):
    """A worker with a random EAGLE-1 head on tiny_llama: only its sampler state and
    EagleStep._accept are used, with logits made here."""
    from gpu.eagle.head_io import random_draft_head, save_draft_head
    from gpu.worker import Worker
    from ipc.worker_config import worker_config

    tiny = dict(model_path=str(tiny_llama), dtype="fp32", max_kv_tokens=256,
                max_running_requests=4, progress=False)
    base = Worker(worker_config(**tiny)).state
    head = random_draft_head(base.model_config, base.model.embed_tokens,
                             base.model.embed_tokens, "eagle", seed=1)
    path = tmp_path_factory.mktemp("tiny-head")
    save_draft_head(head, path)
    spec = SpecSettings("eagle", str(path), num_steps=3, topk=1, num_draft_tokens=4)
    return Worker(worker_config(**tiny, spec=spec))


def verify(runner, params: SamplingParams, drafts: list[int], logits: torch.Tensor,
           generated: list[int]) -> list[int]:
    """Slot 1 runs `params` and has generated `generated`; a chain root -> drafts is verified
    against `logits` [len(drafts) + 1, vocab]. Returns the emitted tokens."""
    state = runner.state.sampling_state
    state.set_request(1, params, [])
    slots = torch.tensor([1])
    if generated:
        state.record_outputs(slots.repeat(len(generated)), torch.tensor(generated))
    tree = chain_tree(torch.tensor([ROOT]), torch.tensor([drafts]))
    positions = torch.arange(len(drafts) + 1)[None, :] + 10
    result = EagleStep._accept(runner.step, tree, logits, slots, np.array([1]), positions)
    out = result.accepted_tokens[0]
    return out[out >= 0].tolist()


def chain_logits(vocab: int, favourites: list[tuple[int, float]]) -> torch.Tensor:
    """One row per node: 1.0 everywhere but the (token, logit) favoured there."""
    logits = torch.ones(len(favourites), vocab)
    for row, (token, value) in enumerate(favourites):
        logits[row, token] = value
    return logits


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_a_draft_accepted_earlier_in_the_step_counts_for_the_penalty(spec_runner, greedy):
    # Every node favours A by 1.5 over B. Plain decoding emits A, then (A's count 1, penalty 2)
    # B. Verify used to score every node with the counts from before the step, so it accepted
    # A, A, A: the frequency penalty missed the drafts accepted above each node.
    vocab = spec_runner.state.sampling_state.vocab_size
    # Seeded: at temperature 0.05 the 1.5 lead (and, after the penalty, the 0.5 loss) is
    # decisive, so rejection sampling must give the same tokens.
    params = SamplingParams(temperature=0.0 if greedy else 0.05, frequency_penalty=2.0, seed=3)
    logits = chain_logits(vocab, [(A, 4.0)] * 4)
    logits[:, B] = 2.5
    emitted = verify(spec_runner, params, [A, A, A], logits, generated=[])
    assert emitted == [A, B]


def test_min_new_tokens_counts_the_drafts_above_a_node(spec_runner):
    # Two tokens generated, min_new_tokens 3: the root samples token 3 (eos banned), the
    # first draft's node samples token 4, where eos is allowed, as plain decoding allows it.
    vocab = spec_runner.state.sampling_state.vocab_size
    params = SamplingParams(temperature=0.0, min_new_tokens=3)
    logits = chain_logits(vocab, [(EOS, 9.0), (EOS, 9.0), (A, 9.0), (A, 9.0)])
    logits[0, A] = 5.0  # with eos banned the root's choice is A
    emitted = verify(spec_runner, params, [A, EOS, B], logits, generated=[3, 4])
    assert emitted == [A, EOS, A]
