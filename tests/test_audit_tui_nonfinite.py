"""msgpack carries NaN and infinities, and a snapshot with one (a buggy or foreign publisher, a
clock gone wrong) must not close `fmserve top`: the sparklines and the event time stamps
failed on them, which ended the app on the spot."""

from __future__ import annotations

import msgspec
import pytest

from tests.test_tui import SIZE, make_app, pub, req, show, snapshot, table_rows  # noqa: F401
from tui.widgets import RequestDetailScreen

pytestmark = pytest.mark.anyio

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_nan_and_inf_in_a_snapshot_leave_the_monitor_running(pub):
    app = make_app(pub.endpoint)
    running = [req("n1", 1, 40, 10), req("n2", 2, 30, 5)]
    async with app.run_test(size=SIZE) as pilot:
        await show(pilot, app, pub, snapshot(1000.0, running, speculation=True))
        await pilot.press("enter")  # the detail view draws the request's own rates
        assert isinstance(app.screen, RequestDetailScreen)
        for i, fields in enumerate([dict(output_tokens_per_s=NAN, spec_accept_length=NAN),
                                    dict(output_tokens_per_s=INF, spec_accept_length=-INF,
                                         uptime_s=NAN),
                                    dict(uptime_s=INF, time=1002.0 + 1e300)]):
            t = 1001.0 + i
            snap = msgspec.structs.replace(snapshot(t, running, speculation=True), **fields)
            await show(pilot, app, pub, snap)
            await pilot.pause(0.2)  # drawn
            assert app.is_running
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
