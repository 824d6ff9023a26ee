"""`fmserve bench soak`: a real `fmserve serve` under a long, hostile load.

--concurrency streams, each one request at a time for --minutes, over raw ZMQ frames (so every
reply is seen): chats of random length and sampling, some aborted after a few chunks, some
left behind by a client that vanishes mid-stream, and now and then a malformed frame instead of
a request. Every --kill-every-s seconds the worker is SIGKILLed (once the previous one is back
and serving). Reported: requests sent / finished / errored / vanished / lost (lost = no
terminal message, or more than one: must be 0), malformed frames and their answers, the
service's RSS at start and end, and whether its accounting came back to idle (every page and
slot free, nothing running or waiting). Exits 1 if anything is lost or unanswered, or not idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import psutil
import zmq
import zmq.asyncio
from rich.console import Console

from fmserve.arg_types import add_runtime_args, non_negative_float, positive_float, positive_int
from fmserve.bench.serve import start_service
from fmserve.bench.tables import print_table
from fmserve.default_model import resolve_model_path
from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.client_messages import (Abort, ChatMessage, Chunk, Error, Finished, Generate, Ping,
                                 Stats)
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams

PROMPTS = ["What is 2+2?", "Write a haiku about rain.", "Explain gravity to a child.",
           "List four animals, one per line.", "Tell me a story about a lighthouse keeper."]
# Frames the service must answer with an Error, never a crash or silence. "bad-" ids mark
# the answers that belong to them.
MALFORMED = [b"\xc1", b"", b"\x81\xa4type\xa5bogus", b"\x91" * 100_000 + b"\xc0",
             msgspec.msgpack.encode({"type": "generate", "id": "bad-1", "token_ids": "x"}),
             msgspec.msgpack.encode({"type": "generate", "id": "bad-2", "text": "hi",
                                     "params": {"temperature": -1.0}}),
             b"\x83\xa4type\xa8generate\xa2id\xa5bad-3\xa4text\xa3\xff\xfe\xfd"]
PING = encode(Ping())
PING_EVERY_S = 1.0  # the service drops a client that sends nothing for client_timeout_s
STALL_S = 180.0  # a request with no reply for this long is lost
IDLE_WAIT_S = 90.0  # for the requests of vanished clients to be aborted (client_timeout_s)


@dataclass
class Tally:
    sent: int = 0
    finished: int = 0
    aborted: int = 0  # finished with reason "abort" (counted in finished too)
    errored: Counter = field(default_factory=Counter)  # by error code
    vanished: int = 0
    lost: list[str] = field(default_factory=list)  # what went wrong, per request
    malformed_sent: int = 0
    malformed_answered: int = 0
    tokens: int = 0
    kills: int = 0
    last_served: float = 0.0  # when the latest request that ended with tokens was sent


def add_bench_soak_args(p: argparse.ArgumentParser) -> None:
    add_runtime_args(p, checked=False)
    p.add_argument("--minutes", type=positive_float, default=10.0)
    p.add_argument("--concurrency", type=positive_int, default=32, help="streams at once")
    p.add_argument("--kill-every-s", type=non_negative_float, default=60.0,
                   help="SIGKILL the worker this often (0: never)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48,
                   help="the most a request asks for (each asks for 4 up to this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed on to `fmserve serve --set`")


class Stream:
    """One client: requests one after another on a DEALER socket, a new socket after it
    vanished."""

    stall_s = STALL_S

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, index: int, seed: int,
                 max_new_tokens: int, tally: Tally) -> None:
        self.ctx, self.endpoint, self.index, self.tally = ctx, endpoint, index, tally
        self.rng = random.Random(seed * 1000 + index)
        self.max_new_tokens = max_new_tokens
        self.sock: zmq.asyncio.Socket | None = None
        self.ended: set[str] = set()  # ids that had their terminal message
        self.aborted: set[str] = set()  # ids this client asked to abort
        self.n = 0
        self.last_send = 0.0
        # The first three streams start with a vanishing, a malformed frame and an abort, so
        # that even a short run has each.
        self.first = ("vanish", "malformed", "abort")[index] if index < 3 else None

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.sock is None:
                self.sock = self.ctx.socket(zmq.DEALER)
                self.sock.setsockopt(zmq.LINGER, 0)
                self.sock.connect(self.endpoint)
            action = self.first or self.rng.choices(
                ["run", "abort", "vanish", "malformed"], [0.78, 0.1, 0.08, 0.04])[0]
            # chunks before the abort or the vanishing; none for the first three's
            after = 0 if self.first else self.rng.randint(0, 3)
            self.first = None
            await (self.malformed() if action == "malformed" else self.request(action, after))
        if self.sock is not None:  # late replies: a second terminal would show here
            while await self.sock.poll(500):
                self.check_late(decode_service_reply(await self.sock.recv()))
            self.sock.close()

    async def send(self, frame: bytes) -> None:
        await self.sock.send(frame)
        self.last_send = time.monotonic()

    async def next_reply(self, what: str):
        """The next reply other than a pong or a late one, pinging while waiting; None after
        `stall_s` without one (pongs keep coming from a service that lost the request)."""
        start = time.monotonic()
        while time.monotonic() - start < self.stall_s:
            if time.monotonic() - self.last_send >= PING_EVERY_S:
                await self.send(PING)
            if not await self.sock.poll(int(PING_EVERY_S * 1000)):
                continue
            msg = decode_service_reply(await self.sock.recv())
            rid = getattr(msg, "id", None)
            if isinstance(msg, Error) and (rid is None or rid.startswith("bad-")):
                self.tally.malformed_answered += 1
                if what == "malformed":
                    return msg
            elif rid is not None and rid in self.ended:
                self.check_late(msg)
            elif rid is not None:
                return msg
        return None

    def check_late(self, msg) -> None:
        """A reply for a request that has ended: only the `unknown_request` of an abort that
        came too late is allowed."""
        rid = getattr(msg, "id", None)
        if rid is None or (isinstance(msg, Error) and msg.code == "unknown_request"
                           and rid in self.aborted):
            return
        self.tally.lost.append(f"{rid}: {type(msg).__name__} after its terminal message")

    async def malformed(self) -> None:
        self.tally.malformed_sent += 1
        await self.send(self.rng.choice(MALFORMED))
        await self.next_reply("malformed")

    async def request(self, action: str, after: int = 0) -> None:
        self.n += 1
        rid = f"s{self.index}-{self.n}"
        rng = self.rng
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 9),
                                max_new_tokens=rng.randint(4, self.max_new_tokens))
        sent_at = time.monotonic()
        await self.send(encode(Generate(id=rid, messages=[ChatMessage(
            "user", rng.choice(PROMPTS))], params=params, stream=rng.random() < 0.9)))
        self.tally.sent += 1
        chunks = 0
        while True:
            if action == "vanish" and chunks >= after:
                self.sock.close()  # gone, its request in flight: the service must clean up
                self.sock = None
                self.tally.vanished += 1
                return
            if action == "abort" and chunks >= after and rid not in self.aborted:
                self.aborted.add(rid)
                await self.send(encode(Abort(id=rid)))
            msg = await self.next_reply(rid)
            if msg is None:
                self.tally.lost.append(f"{rid}: no terminal message after {self.stall_s:g} s")
                return
            if msg.id != rid:
                self.tally.lost.append(f"{rid}: a reply for another request: {msg!r}"[:200])
                continue
            if isinstance(msg, Chunk):
                chunks += 1
                self.tally.tokens += len(msg.token_ids)
                continue
            self.ended.add(rid)
            if isinstance(msg, Finished):
                self.tally.finished += 1
                self.tally.aborted += msg.reason == "abort"
                if msg.reason != "abort":
                    self.tally.last_served = max(self.tally.last_served, sent_at)
            else:
                self.tally.errored[msg.code] += 1
            return


def worker_pid(endpoint: str) -> int | None:
    """The first replica's worker process, as the service reports it (a child process may
    also be the standby: worker.standby)."""
    with Client(endpoint) as client:
        return client.health(timeout_s=10.0).replicas[0].pid


async def kill_workers(endpoint: str, every_s: float, deadline: float, tally: Tally,
                       console: Console) -> None:
    """SIGKILL the worker every `every_s`, each time once its replacement has served a request
    sent after the kill (a kill during a restart is another test: issue 33, item 5)."""
    while True:
        await asyncio.sleep(every_s)
        pid = worker_pid(endpoint)
        if time.monotonic() > deadline - 1 or pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        tally.kills += 1
        since = time.monotonic()
        while worker_pid(endpoint) in (None, pid) or tally.last_served < since:
            if time.monotonic() - since > STALL_S:
                console.print(f"the worker did not come back {STALL_S:g} s after kill "
                              f"{tally.kills}: no more kills")
                return
            await asyncio.sleep(0.2)
        console.print(f"kill {tally.kills}: worker {pid} killed, its replacement served a "
                      f"request {time.monotonic() - since:.1f} s later")


async def soak(endpoint: str, args, tally: Tally, console: Console) -> None:
    ctx = zmq.asyncio.Context()
    deadline = time.monotonic() + args.minutes * 60
    streams = [Stream(ctx, endpoint, i, args.seed, args.max_new_tokens, tally)
               for i in range(args.concurrency)]
    killer = asyncio.create_task(kill_workers(endpoint, args.kill_every_s, deadline, tally,
                                              console)) if args.kill_every_s else None
    await asyncio.gather(*(s.run(deadline) for s in streams))
    if killer is not None:
        killer.cancel()
    ctx.term()


def wait_idle(client: Client) -> tuple[bool, Stats]:
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        try:
            s = client.health(timeout_s=10)
        except ServiceUnavailable:  # a busy machine: asked again until the deadline
            if time.monotonic() > deadline:
                raise
            continue
        idle = (s.worker_alive and (s.free_pages, s.free_slots, s.running, s.waiting)
                == (s.total_pages, s.total_slots, 0, 0))
        if idle or time.monotonic() > deadline:
            return idle, s
        time.sleep(0.5)


def rss_mib(pid: int | None) -> str:
    return "-" if pid is None else f"{psutil.Process(pid).memory_info().rss / 2**20:.0f}"


def run_bench_soak(args: argparse.Namespace) -> int:
    console = Console()
    path = resolve_model_path(args.model)
    extra = ["--set", "worker.max_restarts=1000",  # every kill is restarted (the most allowed)
             *(f for kv in args.set for f in ("--set", kv))]
    console.print(f"starting fmserve serve; then {args.minutes:g} min at {args.concurrency} "
                  f"streams, the worker killed every {args.kill_every_s:g} s ...")
    log = tempfile.NamedTemporaryFile(prefix="fmserve-soak-", suffix=".log", delete=False)
    proc, endpoint = start_service(args, path, True, extra, args.concurrency, log=log)
    try:
        with Client(endpoint) as client:  # a request first, so that the start RSS is a working one
            client.complete(messages=[{"role": "user", "content": PROMPTS[0]}],
                            params=SamplingParams(max_new_tokens=4))
        rss_start = rss_mib(proc.pid), rss_mib(worker_pid(endpoint))
        tally = Tally()
        start = time.monotonic()
        asyncio.run(soak(endpoint, args, tally, console))
        wall = time.monotonic() - start
        with Client(endpoint) as client:
            idle, stats = wait_idle(client)
        rss_end = rss_mib(proc.pid), rss_mib(worker_pid(endpoint))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    rows = [["requests sent", str(tally.sent)], ["finished", str(tally.finished)],
            ["  of which aborted by their client", str(tally.aborted)],
            ["errored", ", ".join(f"{n} {c}" for c, n in tally.errored.most_common()) or "0"],
            ["vanished (client gone mid-stream)", str(tally.vanished)],
            ["lost", str(len(tally.lost))],
            ["malformed frames sent / answered",
             f"{tally.malformed_sent} / {tally.malformed_answered}"],
            ["worker kills", str(tally.kills)],
            ["output tokens streamed", f"{tally.tokens} ({tally.tokens / wall:.1f}/s)"],
            ["service RSS MiB start / end", f"{rss_start[0]} / {rss_end[0]}"],
            ["worker RSS MiB start / end", f"{rss_start[1]} / {rss_end[1]}"],
            ["accounting idle at the end", f"{'yes' if idle else 'NO'} (pages "
             f"{stats.free_pages}/{stats.total_pages} free, slots {stats.free_slots}/"
             f"{stats.total_slots}, running {stats.running}, waiting {stats.waiting})"]]
    print_table(console, f"soak: {wall / 60:.1f} min, {args.concurrency} streams, dtype "
                         f"{args.dtype}, {stats.device}", ["", "value"], rows)
    for problem in tally.lost[:20]:
        console.print(f"lost: {problem}")
    ok = not tally.lost and idle and tally.malformed_answered == tally.malformed_sent
    if not ok:
        console.print(f"soak FAILED; the service's log: {log.name}")
    else:
        os.unlink(log.name)
    return 0 if ok else 1
