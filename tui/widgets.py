"""The panels of `fmserve top`. Each panel is a pure `*_text()` function (easy to test) and a
thin widget that redraws it. Anything the snapshot does not carry is shown as "n/a"."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from rich.cells import cell_len, set_cell_size
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Footer, RichLog, Sparkline, Static

from ipc.telemetry import (TEXT_TAIL_CHARS, RequestTelemetry, SpecConfigTelemetry,
                           TelemetrySnapshot)
from tui.events import ERROR, WARNING, MonitorEvent, RequestTrack, SnapshotTracker
from tui.telemetry_feed import FeedStatus

NA = "n/a"
STATE_LABEL = {"waiting": "wait", "prefilling": "prefill", "decoding": "decode"}
LEVEL_STYLE = {ERROR: "bold red", WARNING: "yellow"}


# C0 controls, DEL and C1 (U+009B is CSI to many terminals): request ids come from any client
# and names from model files, and a control character in a cell would reach the terminal.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every control character shown as U+FFFD."""
    return _UNPRINTABLE.sub("\ufffd", text)


def clip(text: str, cells: int) -> str:
    """`printable(text)` cut to at most `cells` terminal columns (CJK and emoji take two)."""
    text = printable(text)
    return text if cell_len(text) <= cells else set_cell_size(text, cells)


def fit(text: str, cells: int) -> str:
    """`printable(text)` cut or padded to exactly `cells` columns, for aligned labels."""
    return set_cell_size(printable(text), cells)


def cell(text: str, cells: int) -> str:
    """A DataTable cell: Textual reads a str cell as markup, so "[/]" in an id would raise."""
    return escape(clip(text, cells))


def finite(values) -> list[float]:
    """The finite values, for a Sparkline: one NaN or infinity makes it raise while drawing,
    and msgpack carries them."""
    return [v for v in values if math.isfinite(v)]


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return NA
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ----- header -------------------------------------------------------------------------------

def spec_settings_text(cfg: SpecConfigTelemetry) -> str:
    """The published `[spec]` settings, short: "eagle3 (steps 4, topk 1, draft 5)": draft depth,
    children per draft node, tree nodes verified per step; ", off above batch 4" when larger
    decode batches run without drafting, ", drafts where measured faster" under "auto"."""
    limit = cfg.disable_above_batch_size
    off = (", drafts where measured faster" if limit == "auto" else
           f", off above batch {limit}" if limit else "")
    return (f"{cfg.algorithm} (steps {cfg.num_steps}, topk {cfg.topk}, "
            f"draft {cfg.num_draft_tokens}{off})")


def header_text(snap: TelemetrySnapshot | None, status: FeedStatus, paused: bool,
                sort_label: str) -> Text:
    out = Text()
    if snap is None:
        out.append("fmserve top  ", style="bold")
        out.append("waiting for the first snapshot\n", style="yellow")
    else:
        w = snap.worker
        spec = "off" if not snap.speculation else \
            spec_settings_text(snap.spec_config) if snap.spec_config else "on (settings n/a)"
        out.append(printable(snap.model), style="bold")
        out.append(printable(f"  {w.device} {w.dtype} attn={w.attention_backend}")
                   + f"  overlap {'on' if snap.overlap else 'off'}  spec {printable(spec)}"
                   f"  uptime {_fmt_duration(snap.uptime_s)}\nworker ")
        if w.alive:
            out.append(f"alive pid {w.pid}", style="green")
        elif w.state == "restarting":
            out.append(f"RESTARTING pid {w.pid}", style="bold yellow")
        else:
            out.append("DOWN", style="bold red")
        out.append(f" restarts {w.restarts}", style="red" if w.restarts else "")
        if w.decode_compile == "native":
            out.append("  decode in C")
        elif w.decode_compile != "off":  # "building": decode steps run eagerly meanwhile
            out.append(f"  compiled decode {w.decode_compile}",
                       style="yellow" if w.decode_compile == "building" else "")
        if snap.draining:
            out.append("  DRAINING (shutting down)", style="bold yellow")
        out.append("  ")
    if status.connected:
        out.append(status.describe(), style="green")
    else:
        out.append(status.describe(), style="bold red")
    if snap is not None:
        out.append(f"  finished {snap.finished_requests}  tokens {snap.total_output_tokens}"
                   f"  retractions {snap.retractions}")
    out.append(f"  sort: {sort_label}")
    if paused:
        out.append("  PAUSED (p resumes)", style="bold reverse yellow")
    return out


# ----- gauges, queue, step timing -----------------------------------------------------------

def gauge_text(label: str, used: int, total: int, width: int, detail: str = "") -> Text:
    frac = used / total if total > 0 else 0.0
    bar_w = max(4, width - len(label) - 2)
    filled = round(frac * bar_w)
    style = "red" if frac > 0.9 else "yellow" if frac > 0.7 else "green"
    out = Text(f"{label} ")
    out.append("█" * filled, style=style)
    out.append("░" * (bar_w - filled), style="grey30")
    out.append(f"\n{used}/{total} {detail}({frac:.0%})")
    return out


def kv_gauge_text(snap: TelemetrySnapshot, width: int) -> Text:
    used = snap.total_pages - snap.free_pages
    out = gauge_text("KV", used * snap.page_size, snap.total_pages * snap.page_size, width,
                     f"tokens, {used}/{snap.total_pages} pages ")
    if snap.prefix_cache_hit_share is not None:  # free pages include the unborrowed cached ones
        out.append(f"\nprefix cache {snap.cached_pages} pages, "
                   f"{snap.prefix_cache_hit_share:.0%} of prompts reused", style="cyan")
    return out.append_text(replicas_text(snap))


REPLICA_STATE = {"ready": ("ready", "green"), "restarting": ("RESTARTING", "bold yellow"),
                 "down": ("DOWN", "bold red")}


def replicas_text(snap: TelemetrySnapshot) -> Text:
    """One line per data-parallel replica (nothing with one): its worker, batch and KV."""
    out = Text()
    for r in snap.replicas if len(snap.replicas) > 1 else ():
        word, style = REPLICA_STATE.get(r.worker_state, (printable(r.worker_state), "red"))
        out.append(f"\nreplica {r.index} ")
        out.append(word, style=style)
        out.append(f" pid {r.pid or NA}  run {r.running} wait {r.waiting}  KV "
                   f"{r.total_pages - r.free_pages}/{r.total_pages}")
        if r.idle_steps:  # a DP attention rank's idle batches
            out.append(f"  idle {r.idle_steps}", style="dim")
        if r.restarts:
            out.append(f"  restarts {r.restarts}", style="red")
    return out


def slots_gauge_text(snap: TelemetrySnapshot, width: int) -> Text:
    return gauge_text("slots", snap.total_slots - snap.free_slots, snap.total_slots, width)


def queue_text(snap: TelemetrySnapshot, limit: int) -> Text:
    out = Text(f"waiting: {len(snap.waiting)}", style="bold")
    out.append("  (request, prompt tokens, waited)\n" if snap.waiting else "\n", style="dim")
    for r in sorted(snap.waiting, key=lambda r: -r.age_s)[:limit]:
        out.append(f"{fit(r.id, 18)} {r.prompt_len:>6}  {r.age_s:6.1f}s\n")
    if len(snap.waiting) > limit:
        out.append(f"... and {len(snap.waiting) - limit} more\n", style="dim")
    return out


def step_timing_text(snap: TelemetrySnapshot, tracker: SnapshotTracker) -> Text:
    steps = snap.recent_steps
    out = Text("step timing", style="bold")
    out.append(f" (last {len(steps)} steps)\n" if steps else "\n")
    if not steps:
        out.append(f"forward {NA}\nno steps yet\n")
    else:
        n = len(steps)
        fwd = sum(s.forward_ms for s in steps) / n
        wall = sum(s.wall_ms for s in steps) / n
        idle = sum(s.idle_ms for s in steps) / n
        out.append(f"forward {fwd:7.1f} ms  step wall {wall:7.1f} ms\n")
        out.append(f"outside forward (schedule+ipc) {max(0.0, wall - fwd):6.1f} ms\n")
        out.append(f"worker idle before a step {idle:6.1f} ms\n")
        out.append(f"batch {sum(s.batch_size for s in steps) / n:5.1f} req  "
                   f"{sum(s.num_tokens for s in steps) / n:6.1f} tok/step\n")
    if tracker.steps_per_s is not None and tracker.worker_busy is not None:
        out.append(f"{tracker.steps_per_s:5.1f} steps/s  worker busy ~{tracker.worker_busy:.0%}\n")
    else:
        out.append(f"steps/s {NA}\n")
    if tracker.service_ms_per_step is not None:  # near the step's time: the service bounds it
        out.append(f"service CPU {tracker.service_ms_per_step:6.2f} ms/step\n")
    idle_share = snap.worker_idle_share
    if not steps:
        out.append(f"overlap efficiency {NA} (no steps yet)", style="dim")
    else:  # the share of worker time spent computing rather than waiting for the scheduler
        out.append(f"overlap efficiency {1 - idle_share:.0%} (idle {idle_share:.0%} since start)")
    return out


# ----- sequence lengths ---------------------------------------------------------------------

def seq_len_chart_text(running: Sequence[RequestTelemetry], width: int, height: int) -> Text:
    """One bar per request (prompt part dim, generated part bright), or a histogram when the
    batch has more requests than the panel has lines."""
    if not running:
        return Text("batch empty", style="dim")
    out = Text()
    rows = max(1, height)
    longest = max(r.seq_len for r in running) or 1
    if len(running) <= rows:
        label_w, num_w = 12, 6
        bar_w = max(4, width - label_w - num_w - 2)
        for r in sorted(running, key=lambda r: r.slot):
            prompt = round(min(r.prompt_len, r.seq_len) / longest * bar_w)
            total = max(1, round(r.seq_len / longest * bar_w))
            out.append(fit(r.id, label_w - 1) + " ")
            out.append("▒" * min(prompt, total), style="blue")
            out.append("█" * max(0, total - prompt), style="cyan")
            out.append(" " * (bar_w - total) + f" {r.seq_len:>{num_w}}\n")
    else:
        bins = max(1, min(rows, 12))
        step = max(1, -(-longest // bins))  # ceil: the last bin holds the longest
        counts = [0] * bins
        for r in running:
            counts[min(bins - 1, r.seq_len // step)] += 1
        num_w = len(str(step * bins))
        bar_w = max(4, width - 2 * num_w - 8)
        top = max(counts)
        for i, c in enumerate(counts):
            out.append(f"{i * step:>{num_w}}-{(i + 1) * step - 1:<{num_w}} ")
            out.append("█" * round(c / top * bar_w), style="cyan")
            out.append(f" {c}\n")
    out.rstrip()
    return out


class SeqLenChart(Widget):
    running: reactive[list[RequestTelemetry]] = reactive(list)  # set: redrawn

    def render(self) -> Text:
        return seq_len_chart_text(self.running, self.size.width, self.size.height)


class EventLog(RichLog):
    def add(self, event: MonitorEvent) -> None:
        try:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        except (OverflowError, ValueError, OSError):  # a snapshot's time out of any range
            stamp = "--:--:--"
        line = Text(f"{stamp} ")
        line.append(printable(event.text), style=LEVEL_STYLE.get(event.level, ""))
        # Wrap at the panel's width (the console's width can be narrower, e.g. 80 headless);
        # before the first layout the width is unknown and RichLog defers the line.
        self.write(line, width=self.scrollable_content_region.width or None)


# ----- request detail -----------------------------------------------------------------------

TEXT_NOTE = ("text off: the service publishes no request text (its "
             "service.telemetry_include_text is false)")
NO_TEXT_YET = "no text yet"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but tab and newline


def output_text(text: str | None, width: int, height: int, console: Console) -> Text:
    """The newest `height` lines of a request's text tail wrapped to `width`: the end of the
    text stays in view as it grows. A tail as long as telemetry sends starts with "…"."""
    if text is None:
        return Text(TEXT_NOTE, style="dim")
    if not text:
        return Text(NO_TEXT_YET, style="dim")
    clean = _CONTROL.sub("\ufffd", text.replace("\r\n", "\n").replace("\t", "    "))
    body = Text("…" if len(text) >= TEXT_TAIL_CHARS else "", style="dim")
    body.append(clean)
    lines = body.wrap(console, max(1, width))
    return Text("\n").join(lines[-max(1, height):])


def output_text_title(track: RequestTrack) -> str:
    text = track.text
    what = "output text" if text is None or len(text) < TEXT_TAIL_CHARS else \
        f"output text (its last {TEXT_TAIL_CHARS} characters)"
    return f"{what}, as last seen" if track.ended_at is not None else f"{what}, live"


def _mean_accept(value: float | None) -> str:
    return "" if value is None else f" (mean {value:.2f})"


def accept_label_text(snap: TelemetrySnapshot, tracker: SnapshotTracker) -> str:
    """The speculation line of the side panel: mean accept length (tokens per verify step),
    and when published, the share of verify steps that accepted each draft position."""
    if not snap.speculation:
        return f"mean accept length {NA} (speculation off)"
    if not tracker.accept_len:
        return f"mean accept length {NA} (no verify steps yet)"
    out = f"mean accept length {tracker.accept_len[-1]:.2f}"
    rates = snap.spec_accept_rate_per_position
    if rates:
        out += "\naccepted by draft position " + " ".join(f"{r:.0%}" for r in rates)
    return out


def detail_summary_text(track: RequestTrack) -> Text:
    s = track.last
    out = Text(f"request {printable(track.id)}", style="bold")
    if track.key != track.id:
        out.append(f"   key {printable(track.key)}")
    out.append(f"\nstate {printable(STATE_LABEL.get(s.state, s.state))}  slot {s.slot}  "
               f"prompt {track.prompt_len}  seq_len {s.seq_len}  generated {s.generated}  "
               f"accept {s.last_accept_len}{_mean_accept(s.accept_length)}  tok/s "
               f"{NA if s.tokens_per_s is None else f'{s.tokens_per_s:.1f}'}  "
               f"seen {s.time - track.first_seen:.1f}s\n")
    if track.ended_at is not None:
        out.append(f"ended: {track.end_note}\n", style="yellow")
    elif track.abort_requested:
        out.append("abort requested\n", style="yellow")
    out.rstrip()
    return out


class OutputText(Widget):
    """A request's text tail, wrapped to the panel and cut to its newest lines."""

    text: reactive[str | None] = reactive(None)  # set: redrawn

    def render(self) -> Text:
        return output_text(self.text, self.content_size.width, self.content_size.height,
                           self.app.console)


class RequestDetailScreen(Screen):
    """One request's fields over time; redrawn by the app whenever a snapshot is applied."""

    BINDINGS = [Binding("escape,enter", "app.pop_screen", "Back"),
                Binding("a", "app.abort", "Abort"), Binding("p", "app.toggle_pause", "Pause"),
                Binding("q", "app.quit", "Quit")]
    HISTORY_ROWS = 200

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.ready = False  # on_mount has built the history table's columns

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(id="detail-summary")
            yield OutputText(id="detail-text")
            yield Static("seq_len over time", classes="caption")
            yield Sparkline([], id="detail-seq")
            yield Static("tokens/s over time", classes="caption")
            yield Sparkline([], id="detail-rate")
            yield DataTable(id="detail-history", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#detail-history", DataTable)
        table.add_columns("t (s)", "state", "slot", "seq_len", "generated", "accept", "tok/s")
        table.can_focus = False  # enter and escape belong to the screen (back to the batch)
        self.ready = True
        self.show(self.app.tracker)  # type: ignore[attr-defined]

    def show(self, tracker: SnapshotTracker) -> None:
        if not self.ready:  # pushed, not mounted yet (the app's tick came first): on_mount shows
            return
        track = tracker.tracks.get(self.key)
        summary = self.query_one("#detail-summary", Static)
        if track is None:
            summary.update(Text(f"request {printable(self.key)}: no longer tracked", style="yellow"))
            return
        summary.update(detail_summary_text(track))
        text = self.query_one("#detail-text", OutputText)
        text.border_title = output_text_title(track)
        text.text = track.text
        samples = list(track.samples)
        self.query_one("#detail-seq", Sparkline).data = [s.seq_len for s in samples]
        self.query_one("#detail-rate", Sparkline).data = finite(s.tokens_per_s or 0.0
                                                                for s in samples)
        table = self.query_one("#detail-history", DataTable)
        table.clear()
        for s in reversed(samples[-self.HISTORY_ROWS:]):
            table.add_row(f"{s.time - track.first_seen:.2f}",
                          cell(STATE_LABEL.get(s.state, s.state), 8),
                          s.slot, s.seq_len, s.generated, s.last_accept_len,
                          NA if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}")
