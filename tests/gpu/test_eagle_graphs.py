"""The EAGLE decode step as CUDA graphs (gpu/eagle/eagle_graphs.py): the static slot buffer,
the buckets, the padding rows on slot 0 and the held publish around the graph must give exactly
the tokens of the eager step. On the CPU the graphs are EagerReplay, so everything around them
is tested here; on a GPU the same tests capture real graphs."""

from __future__ import annotations

import msgspec
import pytest
import torch

from ipc.sampling import SamplingParams
from tests.engine_runs import RequestRun, assert_accounting_empty, run_requests
from tests.gpu.spec_runs import CHAIN, QUESTIONS, TREE, make_engine, scenario

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(engine, overlap: bool, params: list[SamplingParams] | None = None
        ) -> tuple[list[tuple], list[RequestRun]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = run_requests(engine, chats, params or scenario(), overlap)
    assert_accounting_empty(engine)
    return [r.visible for r in runs], runs


@pytest.fixture(scope="module", params=[CHAIN, TREE], ids=["chain", "tree"])
def engine_and_eager(request, model_path):
    """An EAGLE engine without graphs (cuda_graph_max_batch = 0) and its eager greedy rows."""
    engine = make_engine(model_path, request.param, device=DEVICE, cuda_graph_max_batch=0)
    assert engine.worker.step.graphs is None
    rows, runs = run(engine, overlap=False)
    # The shipped head gets drafts accepted: multi-token steps (and trees' KV moves) run.
    assert sum(r.accepted_drafts for r in runs) > 0
    return engine, rows, runs


def test_replays_give_the_tokens_of_the_eager_step(engine_and_eager):
    engine, eager, eager_runs = engine_and_eager
    step = engine.worker.step
    # Four running requests at most (spec_runs): batches of 4, 3 (one padding row), 2 and 1.
    graphs = step.use_graphs(4)
    try:
        assert sorted(graphs.graphs) == [1, 2, 4]
        for overlap in (False, True):
            replays, padded = graphs.replays, graphs.padded_rows
            rows, runs = run(engine, overlap)
            assert rows == eager
            # The same drafts are accepted: the graph runs the same draft tree.
            assert [r.accepted_drafts for r in runs] == [r.accepted_drafts for r in eager_runs]
            assert graphs.replays > replays
            assert graphs.padded_rows > padded  # some batch ran a larger bucket
    finally:
        step.graphs = None


def test_batches_that_sample_or_want_logprobs_run_eagerly(engine_and_eager):
    engine, _, _ = engine_and_eager
    step = engine.worker.step
    graphs = step.use_graphs(4)
    try:
        sampled = [SamplingParams(temperature=0.8, seed=i, max_new_tokens=6)
                   for i in range(len(QUESTIONS))]
        logprobs = [SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=2)
                    for _ in QUESTIONS]
        for params in (sampled, logprobs):
            replays = graphs.replays
            _, runs = run(engine, overlap=True, params=params)
            assert all(r.finish_reason == "length" for r in runs)
            assert graphs.replays == replays  # not one of them took a graph
    finally:
        step.graphs = None


def test_steps_kept_from_drafting_replay_graphs_of_their_own(model_path):
    """Above spec.disable_above_batch_size a step decodes without drafting; where the head
    follows every such step (a GPU: no HeadLag) those steps replay graphs of their own, and
    the batch drafts by replay again once it shrinks to one request, with the same tokens."""
    spec = msgspec.structs.replace(CHAIN, disable_above_batch_size=1)
    engine = make_engine(model_path, spec, device=DEVICE, cuda_graph_max_batch=0)
    step = engine.worker.step
    step.lag = None  # the GPU's way (a CPU worker defers the head: gpu/eagle/head_lag.py)
    eager, _ = run(engine, overlap=False)
    graphs = step.use_graphs(4)
    try:
        assert sorted(graphs.plain_graphs) == [1, 2, 4]
        for overlap in (False, True):
            plain, replays = graphs.plain_replays, graphs.replays
            rows, runs = run(engine, overlap)
            assert rows == eager
            assert graphs.plain_replays > plain  # batches of 2-4: no drafting
            assert graphs.replays - replays > graphs.plain_replays - plain  # ... and of 1
            assert sum(r.accepted_drafts for r in runs) > 0
    finally:
        step.graphs = None
