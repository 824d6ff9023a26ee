"""`fmserve serve --tp 2 --set parallel.dp_attention=true` on the CPU (gloo, two real rank
processes, the tiny fp32 models of test_tensor_parallel.py): each attention rank is a replica
of its own in Stats; concurrent requests land on both ranks and each gives the one-rank offline
Engine's greedy tokens; a lone request leaves the other rank running idle batches, counted and
read through the client (plain and under an EAGLE-3 tree); killing rank 1 mid-request ends
every request of the group with exactly one error and the group restarts and answers again."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from fmserve.engine import Engine
from ipc.client import Client
from ipc.client_messages import Error, Finished, Generate
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.e2e.service_process import ServiceProcess, assert_idle, wait_for_stats
from tests.e2e.test_tensor_parallel import (PROMPTS, rank_pids,  # noqa: F401 (fixtures)
                                            tp_eagle_model, tp_model)
from tests.gpu import family_models as fm

DP_ATTENTION = ("--tp", "2", "--set", "parallel.dp_attention=true")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def one_rank_greedy(path, prompts, spec: SpecSettings | None = None) -> list[list[int]]:
    engine = Engine(model=str(path), dtype="fp32", progress=False, spec=spec)
    return [c.token_ids for c in engine.generate(prompts, [GREEDY] * len(prompts))]


class Dealer:
    """A raw DEALER: sends requests back to back (so they are in flight together) and reads
    every reply, so each request's terminal messages can be counted."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.sock.send(encode(Generate(rid, token_ids=prompt, params=params)))

    def replies(self, rids: list[str], timeout_s: float = 120.0) -> dict[str, list]:
        """Every reply to `rids` until each has a terminal message and 0.5 s pass quietly."""
        got: dict[str, list] = {rid: [] for rid in rids}
        quiet_since, deadline = None, time.monotonic() + timeout_s
        while quiet_since is None or time.monotonic() - quiet_since < 0.5:
            assert time.monotonic() < deadline, got
            if self.sock.poll(100):
                msg = decode_service_reply(self.sock.recv())
                got[msg.id].append(msg)
                continue
            if quiet_since is None and all(any(isinstance(m, (Finished, Error)) for m in v)
                                           for v in got.values()):
                quiet_since = time.monotonic()
        return got

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def tokens(replies: list) -> list[int]:
    return [t for m in replies if hasattr(m, "token_ids") for t in m.token_ids]


def terminals(replies: list) -> list:
    return [m for m in replies if isinstance(m, (Finished, Error))]


def check_two_at_once_and_one_alone(svc: ServiceProcess, expected: list[list[int]],
                                    eagle: bool) -> None:
    """Two requests in flight together: one per attention rank, each the one-rank tokens.
    Then one alone: the other rank runs an idle batch every step, counted in its Stats."""
    dealer = Dealer(svc.endpoint)
    try:
        with Client(svc.endpoint) as client:
            before = client.health().replicas
            assert [r.index for r in before] == [0, 1]
            assert {r.pid for r in before} == {svc.worker_pid()}  # one worker group
            dealer.send("a", PROMPTS[0], GREEDY)
            dealer.send("b", PROMPTS[1], GREEDY)
            got = dealer.replies(["a", "b"])
            assert [len(terminals(got[r])) for r in "ab"] == [1, 1], got
            assert [tokens(got["a"]), tokens(got["b"])] == expected[:2]
            both = client.health().replicas
            assert all(a.steps > b.steps for a, b in zip(both, before)), (before, both)

            alone = client.complete(token_ids=PROMPTS[2], params=GREEDY).token_ids
            assert alone == expected[2]
            after = client.health().replicas
            busy = [r.steps - b.steps for r, b in zip(after, both)]
            idle = [r.idle_steps - b.idle_steps for r, b in zip(after, both)]
            forwards = [r.idle_forwards - b.idle_forwards for r, b in zip(after, both)]
            worked = busy.index(max(busy))  # the rank the lone request was routed to
            assert busy[1 - worked] == 0 and idle[worked] == 0 and forwards[worked] == 0
            # Every step of the lone request, the other rank ran an idle batch: its target
            # forward, and under EAGLE its draft forwards too.
            assert idle[1 - worked] == busy[worked] > 0, (busy, idle)
            assert forwards[1 - worked] > (idle[1 - worked] if eagle else 0)
            assert_idle(client)
    finally:
        dealer.close()


@pytest.fixture(scope="module")
def dp_service(tp_model):
    svc = ServiceProcess(tp_model[1], *DP_ATTENTION, "--max-tokens-per-step", "4096")
    yield svc
    svc.stop()


def test_each_attention_rank_serves_its_requests_with_one_ranks_tokens(tp_model, dp_service):
    model, path = tp_model
    expected = one_rank_greedy(path, PROMPTS)
    assert expected == [fm.reference_greedy(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    check_two_at_once_and_one_alone(dp_service, expected, eagle=False)
    assert "2 DP attention ranks (overlap off)" in dp_service.log_text()


def test_eagle3_tree_on_attention_ranks_gives_one_ranks_tokens(tp_eagle_model):
    path, head = tp_eagle_model
    spec = SpecSettings("eagle3", str(head), num_steps=3, topk=2, num_draft_tokens=6,
                        disable_above_batch_size=0)
    expected = one_rank_greedy(path, PROMPTS)
    assert one_rank_greedy(path, PROMPTS, spec) == expected
    # disable_above_batch_size stays "auto": on attention ranks it always drafts.
    svc = ServiceProcess(path, *DP_ATTENTION, "--spec-algorithm", "eagle3", "--draft-model",
                         str(head), "--spec-topk", "2", "--spec-num-draft-tokens", "6")
    try:
        check_two_at_once_and_one_alone(svc, expected, eagle=True)
    finally:
        assert svc.stop() == 0, svc.log_text()


def test_a_dead_rank_fails_every_request_of_the_group_once_and_the_group_restarts(
        tp_model, dp_service):
    model, path = tp_model
    long = SamplingParams(temperature=0.0, max_new_tokens=1800, ignore_eos=True)
    dealer = Dealer(dp_service.endpoint)
    try:
        with Client(dp_service.endpoint) as client:
            restarts = client.health().worker_restarts
            rank0, rank1 = rank_pids(dp_service)
            dealer.send("long-a", PROMPTS[0], long)
            dealer.send("long-b", PROMPTS[1], long)
            wait_for_stats(client, lambda s: [r.running for r in s.replicas] == [1, 1],
                     "one request running on each attention rank")
            time.sleep(0.3)
            os.kill(rank1, signal.SIGKILL)
            got = dealer.replies(["long-a", "long-b"])
            ends = {rid: terminals(v) for rid, v in got.items()}
            assert all(len(t) == 1 for t in ends.values()), ends
            assert [(type(t[0]).__name__, t[0].code) for t in ends.values()] == \
                [("Error", "worker_died")] * 2, ends

            # The whole group is replaced, both ranks' accounting emptied, and it answers.
            stats = wait_for_stats(client, lambda s: s.worker_state == "ready"
                             and s.worker_restarts == restarts + 1
                             and len(dp_service.worker_pids()) == 1, "the group to restart")
            assert [r.restarts for r in stats.replicas] == [1, 1]
            pids = rank_pids(dp_service)
            assert rank0 not in pids and rank1 not in pids and len(pids) == 2
            again = client.complete(token_ids=PROMPTS[1], params=GREEDY).token_ids
            assert again == fm.reference_greedy(model, PROMPTS[1], GREEDY.max_new_tokens)
            assert_idle(client)
        assert "tensor-parallel rank 1" in dp_service.log_text()
    finally:
        dealer.close()
