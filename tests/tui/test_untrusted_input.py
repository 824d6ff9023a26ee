"""`fmserve top` on input it cannot trust.

It draws request ids that any client chose: they must neither crash the monitor (Textual reads
a plain str table cell as markup), nor reach the terminal as escape sequences, nor push the
fixed-width panels (sequence lengths, queue) out of line when they are wide. And a snapshot
with NaN or an infinity (msgpack carries them) must not close it."""

from __future__ import annotations

import re

import msgspec
import pytest
from rich.cells import cell_len

from tests.tui.helpers import SIZE, events_text, make_app, req, show, snapshot, table_rows
from tui.widgets import RequestDetailScreen

pytestmark = pytest.mark.anyio

# C0 and C1 control characters; a terminal acts on ESC (0x1b) and on CSI (0x9b).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def screen_strips(app) -> list[str]:
    """The text of every line the compositor would write, without Textual's own controls."""
    return ["".join(seg.text for seg in strip if not seg.control)
            for strip in app.screen._compositor.render_strips()]


async def test_markup_and_escapes_in_request_ids(pub):
    app = make_app(pub.endpoint)
    running = [req("[/]", 1, 40, 10), req("[bold red]x", 2, 30, 5),
               req("a\x1b[2Jb\x9b31m\x07", 3, 20, 2)]
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(1000.0, running,
                                             [req("q\x1b]0;title\x07", 0, 12, 0, "waiting")]))
        await pilot.pause(0.2)
        assert app.is_running
        lines = screen_strips(app)
        # Shown as written, not read as markup.
        assert any(re.search(r"│ \[/\] +1 +decode", ln) for ln in lines), "\n".join(lines)
        assert any(re.search(r"│ \[bold red\]x +2 +decode", ln) for ln in lines)
        await show(pilot, app, pub, snapshot(1001.0, [], finished=3))  # they leave: events
        await pilot.pause(0.2)
        assert "[/]" in events_text(app)
        lines = screen_strips(app)
        assert not [ln for ln in lines if CONTROL.search(ln)], "control characters on screen"
        await show(pilot, app, pub, snapshot(1002.0, running))
        await pilot.press("down", "down", "enter")  # the detail view of the escape-laden id
        await pilot.pause(0.2)
        assert app.screen.key.endswith("a\x1b[2Jb\x9b31m\x07")  # the key itself is kept
        lines = screen_strips(app)
        assert not [ln for ln in lines if CONTROL.search(ln)], "control characters on screen"


async def test_wide_ids_keep_the_panels_in_line(pub):
    app = make_app(pub.endpoint)
    wide = "请求编号很长的中文😀😀😀"
    running = [req(wide, 1, 10, 2), req("b", 2, 30, 2)]
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(2000.0, running,
                                             [req("等待中的请求😀😀😀😀😀", 0, 10, 0, "waiting"),
                                              req("w2", 0, 10, 0, "waiting")]))
        await pilot.pause(0.2)
        chart = app.query_one("#seqlens").render().plain.splitlines()
        assert len(chart) == 2, chart  # one line per request, none wrapped
        width = app.query_one("#seqlens").size.width
        assert all(cell_len(line) <= width for line in chart)
        # The numbers of both bars end in the same column.
        ends = [cell_len(line.rstrip()) for line in chart]
        assert ends[0] == ends[1], chart
        queue = app.query_one("#queue").render().plain.splitlines()[1:3]
        cols = [cell_len(line[:line.index(" 10 ")]) for line in queue]
        assert cols[0] == cols[1], queue  # the prompt-token column lines up


# ----- NaN and infinities in a snapshot -----
# msgpack carries NaN and infinities, and a snapshot with one (a buggy or foreign publisher, a
# clock gone wrong) must not close `fmserve top`: the sparklines and the event time stamps
# failed on them, which ended the app on the spot.

NAN, INF = float("nan"), float("inf")


async def test_nan_and_inf_in_a_snapshot_leave_the_monitor_running(pub):
    app = make_app(pub.endpoint)
    running = [req("n1", 1, 40, 10), req("n2", 2, 30, 5)]
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(1000.0, running, speculation=True))
        await pilot.press("enter")  # the detail view draws the request's own rates
        assert isinstance(app.screen, RequestDetailScreen)
        for i, fields in enumerate([dict(output_tokens_per_s=NAN, spec_accept_length=NAN,
                                         service_cpu_ms=NAN),
                                    dict(output_tokens_per_s=INF, spec_accept_length=-INF,
                                         uptime_s=NAN, service_cpu_ms=INF),
                                    dict(uptime_s=INF, time=1002.0 + 1e300)]):
            t = 1001.0 + i
            snap = msgspec.structs.replace(snapshot(t, running, speculation=True), **fields)
            await show(pilot, app, pub, snap)
            await pilot.pause(0.2)  # drawn
            assert app.is_running
            assert app.tracker.service_ms_per_step is None  # not "nan ms/step"
        # A request leaves while the snapshot's time is out of any clock's range: an event.
        gone = msgspec.structs.replace(snapshot(1004.0, running[1:], finished=1), time=INF)
        await show(pilot, app, pub, gone)
        await pilot.pause(0.2)
        assert app.is_running
        await pilot.press("escape")
        # Good snapshots again: shown as ever.
        await show(pilot, app, pub, snapshot(1005.0, [req("n2", 2, 33, 8)]))
        await pilot.pause(0.2)
        assert [row[3] for row in table_rows(app)] == [33]
        assert "throughput   123.5 tok/s" in str(app.query_one("#throughput-label").render())
