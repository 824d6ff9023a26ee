"""`fmserve top`: a live monitor of the service, fed by its telemetry snapshots.

Telemetry is read in a thread worker that keeps only the newest snapshot (`TelemetryFeed`);
a timer applies it a few times a second, so a burst of snapshots costs one redraw and the
keyboard stays responsive under load. `p` freezes the screen, `s` cycles the sort column,
`enter` opens the selected request, `a` aborts it, `q` quits.

`a` sends the service an `AdminAbort` naming the request by its service-wide key (a plain
`Abort` only reaches requests of the connection that sent them) and the admin token; the owner's
stream ends with `Finished(reason="abort")` and the service answers the monitor with `Aborted`
or `Error`. Without a token the monitor does not send it and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.coordinate import Coordinate
from textual.markup import escape
from textual.widgets import DataTable, Footer, Label, Sparkline, Static

from ipc.client_messages import ADMIN_TOKEN_ENV, AdminAbort, Error
from ipc.codec import ProtocolError, decode_service_reply, encode
from ipc.curve import CurveClient
from ipc.telemetry import RequestTelemetry, TelemetrySnapshot
from tui.events import ERROR, INFO, WARNING, MonitorEvent, SnapshotTracker, request_key
from tui.telemetry_feed import DEFAULT_TELEMETRY_ENDPOINT, TelemetryFeed
from tui.widgets import (
    NA,
    STATE_LABEL,
    EventLog,
    RequestDetailScreen,
    SeqLenChart,
    accept_label_text,
    cell,
    finite,
    header_text,
    kv_gauge_text,
    queue_text,
    slots_gauge_text,
    step_timing_text,
)

DEFAULT_CLIENT_ENDPOINT = "tcp://127.0.0.1:5557"
ABORT_REPLY_TIMEOUT_S = 3.0
ABORT_UNAVAILABLE = (f"abort is unavailable: it needs the service's admin token (its "
                     f"service.admin_token); start fmserve top with --admin-token or "
                     f"{ADMIN_TOKEN_ENV}")


@dataclass(frozen=True)
class SortColumn:
    key: str  # DataTable column key
    label: str
    descending: bool


COLUMNS = [("id", "request", 22), ("slot", "slot", 4), ("state", "state", 7),
           ("seq_len", "seq_len", 7), ("generated", "generated", 9), ("accept", "accept", 6),
           ("tok_s", "tok/s", 7)]
SORTS = [SortColumn("slot", "slot", False), SortColumn("seq_len", "seq_len", True),
         SortColumn("generated", "generated", True), SortColumn("tok_s", "tok/s", True),
         SortColumn("accept", "accept", True), SortColumn("id", "request", False),
         SortColumn("state", "state", False)]


class Rate:
    """A tokens/s cell: sorts by value (unknown first), renders right-aligned or "n/a"."""

    __slots__ = ("value",)

    def __init__(self, value: float | None) -> None:
        self.value = value

    def sort_value(self) -> float:
        return float("-inf") if self.value is None else self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rate) and self.value == other.value

    def __rich__(self) -> Text:
        return Text(NA if self.value is None else f"{self.value:.1f}", justify="right")


def _row(r: RequestTelemetry, rate: float | None) -> tuple:
    return (cell(r.id, 22), r.slot, cell(STATE_LABEL.get(r.state, r.state), 7), r.seq_len,
            r.generated, r.last_accept_len, Rate(rate))


def _sort_key(value):
    return value.sort_value() if isinstance(value, Rate) else value


class TopApp(App):
    TITLE = "fmserve top"
    CSS = """
    #header { height: 3; padding: 0 1; background: $boost; }
    #main { height: 1fr; }
    #batch { width: 2fr; height: 100%; border: round $primary; }
    #side { width: 1fr; min-width: 40; border: round $primary; padding: 0 1; }
    #lower { height: 10; }
    #seqlens { width: 2fr; border: round $primary; padding: 0 1; }
    #queue { width: 1fr; height: 100%; min-width: 40; border: round $primary; padding: 0 1; }
    #events { height: 7; border: round $primary; }
    #side Sparkline { height: 1; }
    #side Label { margin-top: 1; }
    RequestDetailScreen #detail-summary { height: auto; padding: 0 1; background: $boost; }
    RequestDetailScreen #detail-text { height: 10; border: round $primary; padding: 0 1; }
    RequestDetailScreen Sparkline { height: 3; }
    RequestDetailScreen .caption { color: $text-muted; padding: 0 1; }
    """
    BINDINGS = [Binding("p", "toggle_pause", "Pause"), Binding("s", "cycle_sort", "Sort"),
                Binding("enter", "open_detail", "Detail", show=True),
                Binding("a", "abort", "Abort"),
                Binding("w", "save_svg", "SVG screenshot"),
                Binding("q", "quit", "Quit")]

    def __init__(self, telemetry_endpoint: str = DEFAULT_TELEMETRY_ENDPOINT,
                 client_endpoint: str = DEFAULT_CLIENT_ENDPOINT, *, refresh_s: float = 0.25,
                 stale_after_s: float = 2.0, reconnect_every_s: float = 3.0,
                 admin_token: str = "", curve: CurveClient | None = None,
                 feed: TelemetryFeed | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`admin_token`: the service's, for `a` ("": abort is unavailable); `curve`: the keys
        of a CURVE service, for both sockets. `feed` replaces the ZMQ reader (anything with
        run/stop/take/status and an endpoint) and `clock` the time stamp of the monitor's own
        events: tests use both to draw the same screen on every run."""
        super().__init__()
        self.client_endpoint = client_endpoint
        self.admin_token = admin_token
        self.curve = curve
        self.refresh_s = refresh_s
        self.clock = clock
        self.feed = feed if feed is not None else TelemetryFeed(
            telemetry_endpoint, stale_after_s=stale_after_s, reconnect_every_s=reconnect_every_s,
            curve=curve)
        self.tracker = SnapshotTracker()
        self.snapshot: TelemetrySnapshot | None = None  # the one on screen
        self.paused = False
        self.sort_index = 0
        self.applied = 0  # snapshots applied to the screen (for tests and the curious)
        self._rows: dict[str, tuple] = {}
        self._was_connected: bool | None = None
        self._logged_error: str | None = None  # the feed's decode error last put in the log

    # ----- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as attributes: the timer updates them whichever screen is on top.
        self.header = Static(id="header")
        self.table = DataTable(id="batch", cursor_type="row", zebra_stripes=True)
        self.kv = Static(id="kv")
        self.slots = Static(id="slots")
        self.throughput_label = Label("throughput", id="throughput-label")
        self.throughput = Sparkline([], id="throughput")
        self.accept_label = Label("mean accept length", id="accept-label")
        self.accept = Sparkline([], id="accept")
        self.steps = Static(id="steps")
        self.side = Vertical(id="side")
        self.seq_lens = SeqLenChart(id="seqlens")
        self.queue = Static(id="queue")
        self.events = EventLog(id="events", max_lines=500, wrap=True)
        yield self.header
        with Horizontal(id="main"):
            yield self.table
            with self.side:
                yield from (self.kv, self.slots, self.throughput_label, self.throughput,
                            self.accept_label, self.accept, self.steps)
        with Horizontal(id="lower"):
            yield self.seq_lens
            yield self.queue
        yield self.events
        yield Footer()

    def on_mount(self) -> None:
        table = self.table
        for key, label, width in COLUMNS:
            table.add_column(label, width=width, key=key)
        table.border_title = "running batch"
        table.border_subtitle = "enter: details  a: abort  s: sort" if self.admin_token else \
            "enter: details  s: sort  (abort needs --admin-token)"
        self.side.border_title = "memory, throughput, steps"
        self.seq_lens.border_title = "sequence lengths"
        self.queue.border_title = "queue"
        self.events.border_title = "events"
        self._log(MonitorEvent(self.clock(), INFO, f"watching telemetry at {self.feed.endpoint}"))
        self.table.focus()  # the arrow keys and enter belong to the batch
        self._read_telemetry()
        self.set_interval(self.refresh_s, self._tick)
        self._tick()

    def on_unmount(self) -> None:
        self.feed.stop()

    @work(thread=True, exclusive=True, group="telemetry")
    def _read_telemetry(self) -> None:
        self.feed.run()

    # ----- applying snapshots ----------------------------------------------------------------

    def _tick(self) -> None:
        status = self.feed.status()
        if status.connected != self._was_connected and self._was_connected is not None:
            if status.connected:
                self._log(MonitorEvent(self.clock(), INFO, f"connected to {status.endpoint}"))
            else:
                self._log(MonitorEvent(self.clock(), ERROR, status.explain()))
        self._was_connected = status.connected
        if status.last_error is not None and status.last_error != self._logged_error:
            self._log(MonitorEvent(self.clock(), ERROR, f"a telemetry frame from "
                                   f"{status.endpoint} could not be read: {status.last_error}"))
        self._logged_error = status.last_error  # None again after a good snapshot
        if not self.paused:
            snap = self.feed.take()
            if snap is not None:
                self.apply(snap)
        self.header.update(
            header_text(self.snapshot, status, self.paused, SORTS[self.sort_index].label))
        if self.snapshot is not None:
            stale = "" if status.connected else f", stale: {status.describe()}"
            self.table.border_title = f"running batch ({len(self._rows)}{escape(stale)})"

    def apply(self, snap: TelemetrySnapshot) -> None:
        """Show one snapshot: table, panels, events, and the detail screen if open."""
        for event in self.tracker.update(snap):
            self._log(event)
        self.snapshot = snap
        self.applied += 1
        self._update_table(snap)
        side_w = max(10, self.kv.size.width)
        self.kv.update(kv_gauge_text(snap, side_w))
        self.slots.update(slots_gauge_text(snap, side_w))
        peak = max(finite(self.tracker.throughput), default=0.0)
        self.throughput_label.update(
            f"throughput {snap.output_tokens_per_s:7.1f} tok/s (peak {peak:.1f})")
        self.throughput.data = finite(self.tracker.throughput)
        self.accept_label.update(accept_label_text(snap, self.tracker))
        self.accept.data = finite(self.tracker.accept_len)
        self.steps.update(step_timing_text(snap, self.tracker))
        self.seq_lens.running = list(snap.running)
        self.seq_lens.border_title = f"sequence lengths ({len(snap.running)} running; " \
                                     f"▒ prompt, █ generated)"
        self.queue.update(queue_text(snap, limit=max(1, self.queue.size.height - 1)))
        if isinstance(self.screen, RequestDetailScreen):
            self.screen.show(self.tracker)

    def _update_table(self, snap: TelemetrySnapshot) -> None:
        table = self.table
        selected = self._cursor_key(table)
        new = {request_key(r): _row(r, self.tracker.rate(request_key(r))) for r in snap.running}
        for key in [k for k in self._rows if k not in new]:
            table.remove_row(key)
            del self._rows[key]
        for key, values in new.items():
            old = self._rows.get(key)
            if old is None:
                table.add_row(*values, key=key)
            else:
                for (col, _, _), before, after in zip(COLUMNS, old, values):
                    if before != after:
                        table.update_cell(key, col, after)
            self._rows[key] = values
        sort = SORTS[self.sort_index]
        table.sort(sort.key, key=_sort_key, reverse=sort.descending)
        if selected in self._rows:  # keep the cursor on the same request after a sort
            row = table.get_row_index(selected)
            if row != table.cursor_row:
                table.move_cursor(row=row, animate=False)

    def _log(self, event: MonitorEvent) -> None:
        self.events.add(event)

    # ----- keys ------------------------------------------------------------------------------

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        if message.data_table.id == "batch" and message.row_key is not None:
            self.push_screen(RequestDetailScreen(message.row_key.value))

    def selected_key(self) -> str | None:
        """The request under the cursor (or shown in the detail screen)."""
        if isinstance(self.screen, RequestDetailScreen):
            return self.screen.key
        return self._cursor_key(self.table)

    @staticmethod
    def _cursor_key(table: DataTable) -> str | None:
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value

    def action_open_detail(self) -> None:
        key = self.selected_key()
        if key is not None and not isinstance(self.screen, RequestDetailScreen):
            self.push_screen(RequestDetailScreen(key))

    def action_save_svg(self) -> None:
        """An SVG of the screen as it is, into the working directory (for docs and bug reports)."""
        path = self.save_screenshot(path=".")
        self.notify(f"screenshot saved: {path}")

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._tick()

    def action_cycle_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(SORTS)
        if self.snapshot is not None:
            self._update_table(self.snapshot)
        self._tick()

    def action_abort(self) -> None:
        key = self.selected_key()
        if key is None:
            self._log(MonitorEvent(self.clock(), WARNING, "abort: no request selected"))
            return
        if not self.admin_token:
            self._log(MonitorEvent(self.clock(), WARNING, ABORT_UNAVAILABLE))
            return
        track = self.tracker.tracks.get(key)
        if track is not None and track.ended_at is not None:
            self._log(MonitorEvent(self.clock(), WARNING, f"abort {key}: it has already ended"))
            return
        self.tracker.mark_abort_requested(key)
        self._log(MonitorEvent(self.clock(), INFO, f"abort {key}: sent to {self.client_endpoint}"))
        self._send_abort(key)

    @work(thread=True, group="abort")
    def _send_abort(self, key: str) -> None:
        event = send_admin_abort(self.client_endpoint, key, self.admin_token, self.curve)
        self.call_from_thread(self._abort_answered, key, event)

    def _abort_answered(self, key: str, event: MonitorEvent) -> None:
        if event.level == ERROR and key in self.tracker.tracks:  # refused: it ends on its own
            self.tracker.tracks[key].abort_requested = False
        self._log(event)


def send_admin_abort(endpoint: str, key: str, token: str, curve: CurveClient | None = None,
                     timeout_s: float = ABORT_REPLY_TIMEOUT_S) -> MonitorEvent:
    """Send `AdminAbort(key, token)` on a fresh DEALER socket and describe the answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
        sock.send(encode(AdminAbort(key, token)))  # the request's service-wide key
        if not sock.poll(int(timeout_s * 1000)):
            return MonitorEvent(time.time(), WARNING,
                                f"abort {key}: no answer from {endpoint} within {timeout_s:g} s;"
                                f" is the service running? (watch the batch: it may still end)")
        try:
            reply = decode_service_reply(sock.recv())
        except ProtocolError as exc:
            return MonitorEvent(time.time(), WARNING, f"abort {key}: unreadable answer: {exc}")
        if isinstance(reply, Error):
            return MonitorEvent(time.time(), ERROR,
                                f"abort {key} refused: [{reply.code}] {reply.message}")
        return MonitorEvent(time.time(), INFO, f"abort {key}: accepted by the service")
    finally:
        sock.close(linger=0)
        ctx.term()
