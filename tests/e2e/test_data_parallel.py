"""`fmserve serve --dp 2` with the real default model: two worker processes behind one service,
each with its own KV pages and batch. Concurrent requests land on both replicas and give the
offline engine's greedy text; `fmserve top` shows a row per replica; killing one replica's
worker ends its request with one error while the other replica answers on, and it restarts."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq

from ipc.client import Client
from ipc.client_messages import Chunk, Error, Finished, Generate
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess, assert_idle, engine_greedy, wait_for_stats
from tests.tui.helpers import SIZE, make_app, screen_text, until

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
QUESTIONS = ["What is 2+2?", "Name a color.", "Write one word about the sea.",
             "Say hello in French."]


@pytest.fixture(scope="module")
def dp_service(model_path):
    # A long client timeout: the test's raw DEALER reads its replies only at the end.
    svc = ServiceProcess(model_path, "--dp", "2", "--set", "service.client_timeout_s=120")
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy outputs of the offline engine (one worker in this process)."""
    return engine_greedy(model_path, QUESTIONS, GREEDY)


def replica_metrics(svc: ServiceProcess) -> dict[tuple[str, tuple], float]:
    """The `fmserve:replica_*` samples of GET /metrics: (name, label values) -> value."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(httpx.get(svc.http_url + "/metrics").text)
            for s in fam.samples if s.name.startswith("fmserve:replica_")}


def replicas(client: Client) -> list:
    stats = client.health()
    assert len(stats.replicas) == 2, stats
    return stats.replicas


def ask_at_once(endpoint: str, questions: list[str]) -> dict[str, list[int]]:
    """Each question on its own connection, all at once: the greedy token ids of each."""
    got: dict[str, list[int]] = {}

    def run(q: str) -> None:
        with Client(endpoint) as c:
            got[q] = c.complete(messages=[{"role": "user", "content": q}], params=GREEDY,
                                timeout_s=120).token_ids

    threads = [threading.Thread(target=run, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return got


def test_concurrent_requests_run_on_both_replicas_with_the_engine_greedy_text(
        dp_service, reference):
    with Client(dp_service.endpoint) as client:
        before = replicas(client)
        # Each replica's worker is a child of the service, and Stats names it.
        assert {r.pid for r in before} == set(dp_service.worker_pids())
        assert [r.worker_state for r in before] == ["ready", "ready"]
    got = ask_at_once(dp_service.endpoint, QUESTIONS)
    assert [got.get(q) for q in QUESTIONS] == [r.token_ids for r in reference]
    with Client(dp_service.endpoint) as client:
        after = replicas(client)
        assert all(a.steps > b.steps for a, b in zip(after, before)), (before, after)
        assert_idle(client)


@pytest.mark.anyio
async def test_fmserve_top_shows_a_row_per_replica(dp_service):
    app = make_app(f"tcp://127.0.0.1:{dp_service.tport}", dp_service.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.snapshot is not None and len(app.snapshot.replicas) == 2,
                    timeout_s=30, what="a snapshot with two replicas")
        pids = [r.pid for r in app.snapshot.replicas]
        await pilot.pause(0.1)
        text = screen_text(app.export_screenshot())
        for i, pid in enumerate(pids):
            assert f"replica {i} ready pid {pid}" in text, text


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


def test_a_dead_replica_fails_its_request_once_while_the_other_serves_on(dp_service,
                                                                         reference):
    long = SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(dp_service.endpoint)
    try:
        with Client(dp_service.endpoint) as client:
            restarts = [r.restarts for r in replicas(client)]
            for rid in ("long-a", "long-b"):  # one each: the idle replica is the least loaded
                dealer.send(encode(Generate(rid, text="Count to one thousand.", params=long)))
            stats = wait_for_stats(client, lambda s: [r.running for r in s.replicas] == [1, 1],
                             "one request running on each replica")
            victim = stats.replicas[1]
            os.kill(victim.pid, signal.SIGKILL)
            # Replica 1 restarts; meanwhile the service answers, on replica 0.
            wait_for_stats(client, lambda s: s.replicas[1].worker_state == "restarting",
                     "replica 1 to restart")
            samples = replica_metrics(dp_service)
            assert samples[("fmserve:replica_worker_state",
                            (("replica", "1"), ("state", "restarting")))] == 1
            assert samples[("fmserve:replica_worker_state",
                            (("replica", "0"), ("state", "ready")))] == 1
            assert samples[("fmserve:replica_num_requests_running", (("replica", "0"),))] == 1
            assert samples[("fmserve:replica_kv_cache_usage_perc", (("replica", "0"),))] > 0
            during = client.complete(messages=[{"role": "user", "content": QUESTIONS[0]}],
                                     params=GREEDY, timeout_s=120)
            assert during.token_ids == reference[0].token_ids
            assert client.health().worker_state == "ready"  # the service still serves

            # Every reply on the connection: exactly one terminal message per request, the
            # error for the dead replica's, the full output for the other's.
            replies: dict[str, list] = {"long-a": [], "long-b": []}
            quiet_since, deadline = None, time.monotonic() + 120
            while quiet_since is None or time.monotonic() - quiet_since < 0.5:
                assert time.monotonic() < deadline, replies
                if dealer.poll(100):
                    msg = decode_service_reply(dealer.recv())
                    replies[msg.id].append(msg)
                    continue
                done = all(any(isinstance(m, (Finished, Error)) for m in v)
                           for v in replies.values())
                if done and quiet_since is None:
                    quiet_since = time.monotonic()
            terminals = {rid: [m for m in v if isinstance(m, (Finished, Error))]
                         for rid, v in replies.items()}
            assert all(len(t) == 1 for t in terminals.values()), terminals
            ends = sorted((type(t[0]).__name__, getattr(t[0], "code", None) or t[0].reason)
                          for t in terminals.values())
            assert ends == [("Error", "worker_died"), ("Finished", "length")], terminals
            survivor = next(rid for rid, t in terminals.items() if isinstance(t[0], Finished))
            assert sum(len(m.token_ids) for m in replies[survivor]
                       if isinstance(m, Chunk)) == 120

            # Replica 1 is back, with its own restart counted, and takes work again.
            stats = wait_for_stats(client, lambda s: s.replicas[1].worker_state == "ready",
                             "replica 1 to be ready again")
            assert [r.restarts for r in stats.replicas] == [restarts[0], restarts[1] + 1]
            assert stats.replicas[1].pid != victim.pid
            assert set(dp_service.worker_pids()) == {r.pid for r in stats.replicas}
            steps = stats.replicas[1].steps
            got = ask_at_once(dp_service.endpoint, QUESTIONS[:2])
            assert [got.get(q) for q in QUESTIONS[:2]] == [r.token_ids for r in reference[:2]]
            assert replicas(client)[1].steps > steps
            assert_idle(client)
    finally:
        dealer.close()
        ctx.term()
