"""A randomised soak of a real service: overlap on, a KV cache small enough to force retractions,
with and without EAGLE, the FutureMap's write/read check on in the worker. Client threads send
requests of every kind at once (greedy and seeded, stop strings, min/max tokens, logprobs,
streamed or not), abort some mid-stream and vanish with others in flight. The invariants:

- every request on a live connection gets exactly one terminal message, and nothing after it
  but the `unknown_request` error of an abort that came too late;
- no request fails (every input is valid), the worker never dies;
- usage counts what was streamed, max_new_tokens holds, a non-streamed request gets one chunk;
- greedy and seeded requests with the same prompt and parameters give the same tokens;
- afterwards every page and slot is free and nothing runs or waits.

The same with the prefix cache on, whose cached pages then come and go under that pressure.
FMSERVE_SOAK_S sets the load's least duration per service (default 7 s; longer runs in the notes).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import zmq

from ipc.client import Client
from ipc.client_messages import Abort, ChatMessage, Chunk, Error, Finished, Generate, Ping, Pong
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess, assert_idle

SOAK_S = float(os.environ.get("FMSERVE_SOAK_S", "7"))
# The load runs SOAK_S and until MIN_DONE requests have completed (a slow machine runs longer
# rather than failing on a throughput floor); SOAK_CAP_S ends a service that stalls.
MIN_DONE = 14
SOAK_CAP_S = SOAK_S + 90
PROMPTS = ["What is 2+2?", "Write a haiku about rain.", "Explain gravity to a child.",
           "List four animals, one per line."]
CLIENTS = 5
PING_EVERY_S = 0.4
# The service below drops clients silent this long: soon enough to see the vanished ones here,
# with room for a live client thread held up on a loaded machine (in the TUI's live test, a
# client with 1 s between its ping interval and the timeout lost its requests).
CLIENT_TIMEOUT_S = 3.0
PING = encode(Ping())


@dataclass
class Sent:
    rid: str
    prompt: str
    params: SamplingParams
    stream: bool
    abort_after: int | None  # abort once this many chunks came (None: never)
    replies: list = field(default_factory=list)
    aborted: bool = False


# A menu of parameters, so the same (prompt, parameters) comes up again and its tokens can be
# compared: greedy and seeded, stop strings, min/max tokens, logprobs, ignore_eos.
PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=1),
    SamplingParams(temperature=0.0, max_new_tokens=24, logprobs=2),
    SamplingParams(temperature=0.0, max_new_tokens=40, stop=[".", "\n"], min_new_tokens=3),
    SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, stop=[" the"]),
    SamplingParams(temperature=0.7, seed=1, max_new_tokens=24, top_k=20),
    SamplingParams(temperature=1.0, seed=2, max_new_tokens=40, top_p=0.9, logprobs=0),
    SamplingParams(temperature=0.8, seed=0, max_new_tokens=5, min_new_tokens=5, ignore_eos=True),
    SamplingParams(temperature=1.0, max_new_tokens=16),  # unseeded: not compared
]


def random_params(rng: random.Random) -> SamplingParams:
    return rng.choice(PARAMS)


def client_loop(endpoint: str, seed: int, running: Callable[[], bool], done: list[Sent],
                vanished: list[Sent], problems: list[str]) -> None:
    """One client thread: connections one after another, up to 3 requests in flight on each;
    a connection ends by draining its requests, or (1 in 6) by vanishing with them in flight."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    n = 0
    try:
        while running():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            vanish_at = time.monotonic() + rng.uniform(0.5, 4.0) if rng.random() < 1 / 6 else None
            inflight: dict[str, Sent] = {}
            finished: dict[str, Sent] = {}
            to_send = rng.randint(1, 6)
            last_ping = time.monotonic()
            while to_send or inflight:
                now = time.monotonic()
                if vanish_at is not None and now > vanish_at and inflight:
                    vanished.extend(inflight.values())
                    inflight.clear()
                    break
                if to_send and len(inflight) < 3 and running():
                    n += 1
                    s = Sent(f"c{seed}-{n}", rng.choice(PROMPTS), random_params(rng),
                             stream=rng.random() < 0.8,
                             abort_after=rng.choice([None] * 6 + [0, 1]))
                    sock.send(encode(Generate(
                        id=s.rid, messages=[ChatMessage("user", s.prompt)], params=s.params,
                        stream=s.stream)))
                    inflight[s.rid] = s
                    to_send -= 1
                    continue
                if not to_send and not running() and not inflight:
                    break
                if now - last_ping > PING_EVERY_S:
                    sock.send(PING)
                    last_ping = now
                if not sock.poll(50):
                    if not inflight and (not to_send or not running()):
                        break
                    continue
                msg = decode_service_reply(sock.recv())
                if isinstance(msg, Pong):
                    continue
                rid = getattr(msg, "id", None)
                s = inflight.get(rid) or finished.get(rid)
                if s is None:
                    problems.append(f"a reply for an unknown id: {msg!r}")
                    continue
                s.replies.append(msg)
                if rid not in inflight:
                    continue  # after the terminal: checked below
                if isinstance(msg, (Finished, Error)):
                    finished[rid] = inflight.pop(rid)
                    continue
                chunks = sum(isinstance(m, Chunk) for m in s.replies)
                if s.abort_after is not None and not s.aborted and chunks >= s.abort_after:
                    sock.send(encode(Abort(id=rid)))
                    s.aborted = True
            # Late replies (an abort's unknown_request) come within a moment.
            while sock.poll(100):
                msg = decode_service_reply(sock.recv())
                s = finished.get(getattr(msg, "id", None))
                if s is not None:
                    s.replies.append(msg)
            done.extend(finished.values())
            sock.close()
    finally:
        ctx.term()


def check_request(s: Sent, problems: list[str]) -> tuple | None:
    """The per-request invariants; returns (key, token ids) for a request whose tokens must
    repeat, else None."""
    terminal = [i for i, m in enumerate(s.replies) if isinstance(m, (Finished, Error))]
    if not terminal:
        problems.append(f"{s.rid}: no terminal message: {s.replies!r}")
        return None
    first = terminal[0]
    after = s.replies[first + 1:]
    if any(not (isinstance(m, Error) and m.code == "unknown_request" and s.aborted)
           for m in after):
        problems.append(f"{s.rid}: messages after its terminal one: {after!r}")
    end = s.replies[first]
    if isinstance(end, Error):
        problems.append(f"{s.rid}: failed: {end.code}: {end.message}")
        return None
    chunks = [m for m in s.replies[:first] if isinstance(m, Chunk)]
    ids = [t for c in chunks for t in c.token_ids]
    if not s.stream and len(chunks) > 1:
        problems.append(f"{s.rid}: {len(chunks)} chunks for a request with stream=false")
    if end.usage.completion_tokens != len(ids):
        problems.append(f"{s.rid}: usage says {end.usage.completion_tokens} tokens, "
                        f"{len(ids)} were streamed")
    if len(ids) > s.params.max_new_tokens:
        problems.append(f"{s.rid}: {len(ids)} tokens > max_new_tokens {s.params.max_new_tokens}")
    if end.reason == "abort" and not s.aborted:
        problems.append(f"{s.rid}: aborted, but the client never asked")
    if end.reason == "length" and len(ids) < s.params.max_new_tokens:
        problems.append(f"{s.rid}: 'length' after {len(ids)} of {s.params.max_new_tokens}")
    if s.params.logprobs is not None and any(c.logprobs is None or len(c.logprobs) !=
                                             len(c.token_ids) for c in chunks):
        problems.append(f"{s.rid}: logprobs missing or not one per token")
    repeatable = end.reason != "abort" and (s.params.temperature == 0.0
                                            or s.params.seed is not None)
    return ((s.prompt, encode(s.params)), ids) if repeatable else None


# launch_ahead: the worker's GPU orders forced on the CPU for the EAGLE runs ("on": step k+1
# is launched before step k's result is finished and sent; "prepare": its plan applied).
@pytest.mark.parametrize("spec, prefix_cache, launch_ahead",
                         [("none", False, "auto"), ("eagle3", False, "on"),
                          ("eagle3", True, "prepare")],
                         ids=["plain", "eagle3", "eagle3-prefix-cache"])
def test_soak_mixed_load_keeps_every_invariant(model_path, spec, prefix_cache, launch_ahead):
    extra = ["--max-kv-tokens", "768", "--set", f"service.client_timeout_s={CLIENT_TIMEOUT_S}",
             "--set", "service.heartbeat_interval_s=0.5",
             "--set", "scheduling.overlap=true",
             "--set", f"scheduling.launch_ahead={launch_ahead}",
             "--set", "runtime.sync_check=true",  # every launch free of host syncs
             "--set", f"scheduling.prefix_cache={str(prefix_cache).lower()}"]
    if spec != "none":
        # Every decode step drafts: a seeded sampled request repeats its tokens only if its
        # steps go the same way (speculative and plain sampling draw differently), and "auto"
        # chooses by measured speed (gpu/eagle/spec_gate.py).
        extra += ["--spec-algorithm", spec, "--spec-disable-above-batch-size", "0"]
    svc = ServiceProcess(model_path, *extra)
    try:
        done: list[Sent] = []
        vanished: list[Sent] = []
        problems: list[str] = []
        start = time.monotonic()

        def running() -> bool:  # SOAK_S of load and MIN_DONE answers; a stuck service: the cap
            elapsed = time.monotonic() - start
            return elapsed < SOAK_S or (len(done) < MIN_DONE and elapsed < SOAK_CAP_S)

        threads = [threading.Thread(target=client_loop,
                                    args=(svc.endpoint, 100 + i, running, done, vanished,
                                          problems)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SOAK_CAP_S + 120)
            assert not t.is_alive(), "a client thread hung"
        outputs = defaultdict(list)
        for s in done:
            got = check_request(s, problems)
            if got is not None:
                outputs[got[0]].append(got[1])
        for key, runs in outputs.items():
            if any(r != runs[0] for r in runs[1:]):
                problems.append(f"same prompt and parameters, different tokens: {key}: {runs}")
        assert not problems, "\n".join(problems[:20])
        assert len(done) >= MIN_DONE, (f"only {len(done)} requests completed in "
                                       f"{SOAK_CAP_S:.0f} s: the service stalled")
        with Client(svc.endpoint) as client:  # idle once the vanished clients' requests end
            assert_idle(client, timeout_s=CLIENT_TIMEOUT_S + 10)
            stats = client.health()
        assert stats.worker_alive
        if prefix_cache:  # the cache was used, and kept what it could
            assert stats.prefix_cache_hit_tokens > 0 and stats.cached_pages > 0, stats
        log = svc.log_text()
        assert "worker died" not in log.lower() and "Traceback" not in log, log[-4000:]
        print(f"soak ({spec}, prefix cache {prefix_cache}): {len(done)} requests, "
              f"{len(vanished)} vanished, "
              f"{sum(s.aborted for s in done)} aborted, "
              f"{sum(len(r) > 1 for r in outputs.values())} keys repeated")
    finally:
        svc.stop()
