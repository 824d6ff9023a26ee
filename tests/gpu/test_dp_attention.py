"""DP attention (gpu/dp_attention.py) on two real ranks (processes over gloo, the default model
in fp32): each rank runs its own plans in lockstep, the attention whole on each, the MLP cut
across both. A rank with no request runs idle batches (plain, and EAGLE-3's idle draft and
verify forwards) and its partner's tokens are the ones a single rank gives; with one request
per rank each gets its own request's single-rank tokens; a rank that skips its idle batches
makes its partner fail within the collective timeout instead of hanging."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.gpu import dp_rank_runs as dr
from tests.gpu.spec_runs import CHAIN, TREE
from tests.ports import free_port

TIMEOUT_S = 60.0  # a collective no rank answers fails the run after this long
SINGLE_PLAIN = [dr.request_plans(dr.PROMPT_A, 0, 5), [dr.empty_plan(k) for k in range(5)]]
SINGLE_EAGLE = [dr.request_plans(dr.PROMPT_A, 0, 4), [dr.empty_plan(k) for k in range(4)]]
# Rank 1's request starts a step later: its prefill meets rank 0's decode.
ONE_EACH = [dr.request_plans(dr.PROMPT_A, 0, 4), dr.request_plans(dr.PROMPT_B, 1, 4)]
# Rank 0's second request prefills in the plan of its first one's decode (two target forwards
# under EAGLE), while rank 1 decodes only: it must run an idle prefill part too.
MIXED = [dr.merged(ONE_EACH[0], dr.request_plans(dr.PROMPT_B[:7], 2, 4, 2, [5, 6, 7, 8])),
         ONE_EACH[1]]
RUNS = [dict(spec=None, plans=SINGLE_PLAIN), dict(spec=CHAIN, plans=SINGLE_EAGLE),
        dict(spec=None, plans=ONE_EACH), dict(spec=TREE, plans=ONE_EACH),
        dict(spec=CHAIN, plans=MIXED)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    pass


def on_two_ranks(out_dir, model_path, runs, timeout_s: float = TIMEOUT_S) -> list[list[dict]]:
    """Per rank, per run, what dp_rank_runs.rank_main saved."""
    mp.spawn(dr.rank_main, args=(2, free_port(), str(model_path), runs, timeout_s,
                                 str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def ranks(model_path, tmp_path_factory) -> list[list[dict]]:
    return on_two_ranks(tmp_path_factory.mktemp("dp_attention"), model_path, RUNS)


def check_lockstep(ranks, run: int) -> tuple[dict, dict]:
    zero, one = ranks[0][run], ranks[1][run]
    assert zero["error"] is None and one["error"] is None, (zero["error"], one["error"])
    assert zero["forwards"] == one["forwards"] > 0  # the same target forwards on both
    for rank in (zero, one):  # the attention whole on each rank, the MLP cut in two
        assert rank["kv_heads"] == 3 and rank["intermediate"] == 1536 // 2
    return zero, one


@pytest.mark.parametrize("run,spec", [(0, None), (1, CHAIN)], ids=["plain", "eagle3-chain"])
def test_the_empty_rank_runs_idle_batches_and_the_other_gets_one_ranks_tokens(
        ranks, model_path, run, spec):
    busy, idle = check_lockstep(ranks, run)
    plans = RUNS[run]["plans"]
    expected = dr.one_rank(str(model_path), spec, plans[0])
    assert len(expected) >= len(plans[0])
    assert busy["tokens"] == expected
    assert idle["tokens"] == []
    assert idle["idle"]["step"] == len(plans[1])  # every step, counted
    assert idle["idle"]["target"] >= len(plans[1])
    assert busy["idle"].get("step", 0) == 0
    if spec is not None:  # idle draft (tree levels, draft extend) and verify forwards
        assert idle["idle"]["draft"] >= len(plans[1]) * (spec.num_steps - 1)
        assert len(expected) > len(plans[0])  # drafts were accepted on the busy rank


@pytest.mark.parametrize("run,spec", [(2, None), (3, TREE)], ids=["plain", "eagle3-tree"])
def test_one_request_per_rank_each_gets_its_single_rank_tokens(ranks, model_path, run, spec):
    zero, one = check_lockstep(ranks, run)
    assert zero["tokens"] == dr.one_rank(str(model_path), spec, ONE_EACH[0])
    assert one["tokens"] == dr.one_rank(str(model_path), spec, ONE_EACH[1])
    assert one["idle"]["step"] == 1 and zero["idle"].get("step", 0) == 0


def test_an_eagle_prefill_beside_a_decode_on_one_rank_runs_idle_parts_on_the_other(
        ranks, model_path):
    zero, one = check_lockstep(ranks, 4)
    assert zero["tokens"] == dr.one_rank(str(model_path), CHAIN, MIXED[0])
    assert one["tokens"] == dr.one_rank(str(model_path), CHAIN, MIXED[1])
    # Rank 1's step 2 (decode only) ran an idle prefill part: a target forward of no tokens.
    assert one["idle"]["target"] >= 2 and one["idle"]["step"] == 1


def test_a_rank_skipping_its_idle_batches_fails_its_partner_instead_of_hanging(
        model_path, tmp_path):
    # The bug on purpose: rank 1 runs none of its empty plans and stays in the group, so no
    # collective of rank 0's first forward is answered; the bounded timeout must end it.
    runs = [dict(spec=None, plans=SINGLE_PLAIN, skip_empty=(1,))]
    busy, idle = (r[0] for r in on_two_ranks(tmp_path, model_path, runs, timeout_s=4.0))
    assert idle["forwards"] == 0 and idle["error"] is None
    assert busy["tokens"] == [] and busy["error"] is not None
    assert "timed out" in busy["error"].lower(), busy["error"]


def test_dp_attention_needs_two_ranks_and_a_group(tiny_llama):
    from gpu.worker import Worker
    from ipc.worker_config import worker_config

    with pytest.raises(ValueError, match=r"dp_attention = true needs parallel.tp >= 2"):
        worker_config(model_path=str(tiny_llama), dp_attention=True)
    with pytest.raises(ValueError, match=r"dp_attention with parallel.tp = 2 needs 2 ranks"):
        Worker(worker_config(model_path=str(tiny_llama), tp=2, dp_attention=True,
                             progress=False))
