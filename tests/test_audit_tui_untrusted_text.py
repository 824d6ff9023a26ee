"""`fmserve top` draws request ids that any client chose: they must neither crash the monitor
(Textual reads a plain str table cell as markup), nor reach the terminal as escape sequences,
nor push the fixed-width panels (sequence lengths, queue) out of line when they are wide."""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len

from tests.test_tui import SIZE, events_text, make_app, pub, req, show, snapshot  # noqa: F401

pytestmark = pytest.mark.anyio

# C0 and C1 control characters; a terminal acts on ESC (0x1b) and on CSI (0x9b).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


@pytest.fixture
def anyio_backend():
    return "asyncio"


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
