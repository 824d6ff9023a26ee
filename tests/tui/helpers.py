"""What the `fmserve top` tests share: synthetic telemetry snapshots, a real PUB socket to publish
them on, the app made headless, and waits on what it shows."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import msgspec
import zmq
from textual.widgets import DataTable

from ipc.telemetry import RequestTelemetry, StepTelemetry, TelemetrySnapshot, WorkerTelemetry
from tests.e2e.service_process import free_port
from tui.app import TopApp

SIZE = (150, 44)
REFRESH_S = 0.05
CHAR_WIDTH_PX = 12.2  # Rich's export_svg: one terminal column
ROOT = Path(__file__).resolve().parents[2]  # the repository


# ----- synthetic snapshots ------------------------------------------------------------------

def _make(cls, **fields):
    """Build a telemetry Struct from the fields this version of ipc.telemetry has."""
    return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})


def req(rid: str, slot: int, seq_len: int, generated: int, state: str = "decoding",
        accept: int = 0, owner: str = "c0ffee", text: str | None = None) -> RequestTelemetry:
    return _make(RequestTelemetry, id=rid, slot=slot, state=state,
                 prompt_len=seq_len - generated, seq_len=seq_len, generated=generated,
                 last_accept_len=accept, age_s=1.0, key=f"{owner}/{rid}", text_tail=text)


def snapshot(t: float, running=(), waiting=(), *, retractions=0, restarts=0, alive=True,
             pid=4242, finished=0, tokens=0, speculation=False,
             spec_config=None, draining=False) -> TelemetrySnapshot:
    steps = [_make(StepTelemetry, step_id=100 + i, batch_size=len(running), num_tokens=8,
                   forward_ms=20.0, wall_ms=25.0, idle_ms=5.0) for i in range(4)]
    return _make(TelemetrySnapshot, time=t, uptime_s=3725.0, model="SmolLM2-135M-Instruct",
                 overlap=True,
                 speculation=speculation, running=list(running), waiting=list(waiting),
                 free_pages=192, total_pages=256, page_size=16, free_slots=5, total_slots=9,
                 output_tokens_per_s=123.5, total_output_tokens=tokens,
                 finished_requests=finished, retractions=retractions, recent_steps=steps,
                 worker_idle_share=0.25,
                 worker=WorkerTelemetry(alive=alive, pid=pid, restarts=restarts, device="cpu",
                                        dtype="fp32", attention_backend="torch",
                                        state="ready" if alive else "down"),
                 spec_config=spec_config, draining=draining)


class Publisher:
    """A real PUB socket on a free port, like the service's."""

    def __init__(self, port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = port or free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    def send(self, snap: TelemetrySnapshot) -> None:
        self.sock.send(msgspec.msgpack.encode(snap))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def make_app(endpoint: str, client_endpoint: str = "tcp://127.0.0.1:1", **kw) -> TopApp:
    return TopApp(endpoint, client_endpoint, refresh_s=REFRESH_S, **kw)


async def until(pilot, cond, timeout_s: float = 10.0, every=None, what: str = "condition"):
    """Wait (re-publishing with `every()` while waiting: PUB drops frames to late joiners)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if every is not None:
            every()
        await pilot.pause(REFRESH_S)


async def show(pilot, app: TopApp, p: Publisher, snap: TelemetrySnapshot) -> None:
    """Publish until the app has applied exactly this snapshot."""
    await until(pilot, lambda: app.snapshot is not None and app.snapshot.time == snap.time,
                every=lambda: p.send(snap), what=f"snapshot t={snap.time}")


def table_rows(app: TopApp) -> list[list]:
    table = app.query_one("#batch", DataTable)
    return [table.get_row_at(i) for i in range(table.row_count)]


def events_text(app: TopApp) -> str:
    return "\n".join(strip.text for strip in app.query_one("#events").lines)


def screen_text(svg: str) -> str:
    """The visible text of an `export_screenshot()` SVG: each <text> run placed at its column
    (runs of blanks are drawn as background only, so positions, not order, give the spacing)."""
    rows: dict[int, dict[int, str]] = {}
    for x, line, content in re.findall(r'<text [^>]*x="([\d.]+)"[^>]*clip-path="url\(#[^)]*-line-'
                                       r'(\d+)\)"[^>]*>(.*?)</text>', svg):
        col = round(float(x) / CHAR_WIDTH_PX)
        for i, ch in enumerate(html.unescape(content).replace("\xa0", " ")):
            rows.setdefault(int(line), {})[col + i] = ch
    return "\n".join("".join(cells.get(c, " ") for c in range(max(cells) + 1)).rstrip()
                     for _, cells in sorted(rows.items()))


