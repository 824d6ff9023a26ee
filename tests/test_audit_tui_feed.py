"""`fmserve top` on a telemetry socket whose frames it cannot read (a service of another
version, another program on the port, a truncated frame): it must say that frames arrive and
why they cannot be read, not that the service is down, and recover at the next good one."""

from __future__ import annotations

import msgspec
import pytest

from tests.test_tui import SIZE, events_text, make_app, pub, req, show, snapshot, until  # noqa: F401

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def header(app) -> str:
    return app.query_one("#header").render().plain


async def test_unreadable_frames_are_reported_and_good_ones_recover(pub):
    app = make_app(pub.endpoint, stale_after_s=0.5, reconnect_every_s=0.5)
    newer = msgspec.msgpack.encode({"type": "snapshot", "time": "2026-01-01"})  # wrong type
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.feed.status().decode_errors >= 3,
                    every=lambda: pub.sock.send(newer), what="frames to arrive")
        await pilot.pause(0.2)
        assert "service down?" not in header(app)
        assert "cannot read" in header(app) and "$.time" in header(app)
        assert "Expected `float`, got `str` - at `$.time`" in events_text(app)
        # A good snapshot: connected again, and the header forgets the error.
        await show(pilot, app, pub, snapshot(1000.0, [req("g1", 1, 10, 2)]))
        await pilot.pause(0.2)
        assert "connected to" in header(app) and "cannot read" not in header(app)
        # A truncated frame after good ones, then silence from the good source.
        good = msgspec.msgpack.encode(snapshot(1001.0, [req("g1", 1, 11, 3)]))
        await until(pilot, lambda: "cannot read" in header(app),
                    every=lambda: pub.sock.send(good[:len(good) // 2]), timeout_s=5,
                    what="the truncated frames to be reported")
        assert "truncated" in events_text(app)
        assert app.is_running
