"""`fmserve bench soak`: a short run against a real service (a worker kill, a vanishing client,
a malformed frame and an abort included) loses nothing and ends idle; and the soak's client
does count as lost a request with no terminal message or with two."""

from __future__ import annotations

import asyncio
import re

import zmq
import zmq.asyncio

from fmserve.bench.soak import Stream, Tally
from fmserve.cli import main
from ipc.client_messages import Finished, Ping, Pong, Usage
from ipc.codec import decode_client_request, encode


def row(text: str, name: str) -> str:
    match = re.search(rf"│\s*{re.escape(name)}\s*│\s*(.+?)\s*│", text)
    assert match, f"no row {name!r} in:\n{text}"
    return match.group(1)


def test_a_short_soak_with_a_worker_kill_loses_nothing_and_ends_idle(model_path, capsys):
    rc = main(["bench", "soak", "--model", str(model_path), "--dtype", "fp32", "--minutes",
               "0.3", "--concurrency", "4", "--kill-every-s", "8", "--max-new-tokens", "8",
               "--set", "service.client_timeout_s=3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert row(out, "lost") == "0"
    assert int(row(out, "worker kills")) >= 1 and "worker_died" in row(out, "errored"), out
    assert int(row(out, "vanished (client gone mid-stream)")) >= 1
    assert int(row(out, "of which aborted by their client")) >= 1
    sent, answered = row(out, "malformed frames sent / answered").split(" / ")
    assert int(sent) >= 1 and sent == answered
    assert row(out, "accounting idle at the end").startswith("yes")


async def soak_client_against(answer_twice: bool) -> Tally:
    """Two soak requests against a ROUTER that answers each with two terminal messages, or
    with none (while it answers every ping)."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tally = Tally()
    stream = Stream(ctx, f"tcp://127.0.0.1:{port}", 3, 0, 4, tally)
    stream.stall_s = 2.0

    async def serve() -> None:
        while True:
            ident, frame = await router.recv_multipart()
            msg = decode_client_request(frame)
            if isinstance(msg, Ping):
                await router.send_multipart([ident, encode(Pong())])
            elif answer_twice:
                done = encode(Finished(msg.id, "stop", Usage(1, 0)))
                await router.send_multipart([ident, done])
                await router.send_multipart([ident, done])

    server = asyncio.create_task(serve())
    stream.sock = ctx.socket(zmq.DEALER)
    stream.sock.connect(stream.endpoint)
    await stream.request("run")
    await stream.request("run")  # the second terminal of the first shows up here
    server.cancel()
    stream.sock.close(linger=0)
    router.close()
    ctx.term()
    return tally


def test_the_soak_counts_a_missing_or_a_second_terminal_as_lost():
    twice = asyncio.run(soak_client_against(answer_twice=True))
    assert twice.finished == 2 and any("after its terminal" in p for p in twice.lost), twice
    never = asyncio.run(soak_client_against(answer_twice=False))
    assert never.finished == 0 and len(never.lost) == 2, never
    assert "no terminal message" in never.lost[0]
