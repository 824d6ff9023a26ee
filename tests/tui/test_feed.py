"""What `fmserve top` makes of its telemetry feed when the service behind it changes.

Frames it cannot read (a service of another version, another program on the port, a truncated
frame): it must say that frames arrive and why they cannot be read, not that the service is
down, and recover at the next good one. A service restarted underneath it: the restart is
noticed even before anything finished, and no rate goes negative."""

from __future__ import annotations

import msgspec
import pytest

from ipc.telemetry import StepTelemetry
from tests.tui.helpers import SIZE, events_text, make_app, req, show, snapshot, until

pytestmark = pytest.mark.anyio


def header(app) -> str:
    return app.query_one("#header").render().plain


async def test_unreadable_frames_are_reported_and_good_ones_recover(pub):
    app = make_app(pub.endpoint, stale_after_s=0.5, reconnect_every_s=0.5)
    newer = msgspec.msgpack.encode({"type": "snapshot", "time": "2026-01-01"})  # wrong type
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.feed.status().decode_errors >= 3,
                    every=lambda: pub.sock.send(newer), what="frames to arrive")
        # They keep coming, as from a live service of another version: on a loaded machine the
        # last one can be 0.5 s old (stale_after_s) by the time the header is drawn.
        await until(pilot, lambda: "cannot read" in header(app),
                    every=lambda: pub.sock.send(newer), what="the header to say why")
        assert "service down?" not in header(app) and "$.time" in header(app)
        assert "Expected `float`, got `str` - at `$.time`" in events_text(app)
        # A good snapshot: connected again, and the header forgets the error. Good ones keep
        # coming meanwhile, as from a live service: on a loaded machine a single one can be
        # 0.5 s old (stale_after_s) by the time the header is read.
        first_good = snapshot(1000.0, [req("g1", 1, 10, 2)])
        await show(pilot, app, pub, first_good)
        await until(pilot, lambda: "connected to" in header(app),
                    every=lambda: pub.send(first_good), what="the header to say connected")
        assert "cannot read" not in header(app)
        # A truncated frame after good ones, then silence from the good source.
        good = msgspec.msgpack.encode(snapshot(1001.0, [req("g1", 1, 11, 3)]))
        await until(pilot, lambda: "cannot read" in header(app),
                    every=lambda: pub.sock.send(good[:len(good) // 2]), timeout_s=5,
                    what="the truncated frames to be reported")
        assert "truncated" in events_text(app)
        assert app.is_running


# ----- a service restarted before it had finished anything -----
# A service restarted under a running `fmserve top` before it had finished anything: the
# monitor took the restart for nothing (it looked only for counters going back, and they were
# 0), reported the lost requests as ended normally, and drew a negative steps/s and worker busy
# share from step ids that started again at 1.


def steps(first: int) -> list[StepTelemetry]:
    return [StepTelemetry(step_id=first + i, batch_size=1, num_tokens=1, forward_ms=20.0,
                          wall_ms=25.0, idle_ms=1.0) for i in range(4)]


async def test_the_services_cpu_time_a_step_comes_from_two_snapshots(pub):
    """service_cpu_ms grows by 10 ms over 4 steps: 2.50 ms a step in the step panel; a snapshot
    without it (an older service) or with no step since the last one shows none."""
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        for i, (t, cpu) in enumerate(((1000.0, 500.0), (1001.0, 510.0))):
            snap = msgspec.structs.replace(snapshot(t, [req("a", 1, 40 + i, 10 + i)]),
                                           recent_steps=steps(500 + 4 * i), service_cpu_ms=cpu)
            await show(pilot, app, pub, snap)
        assert app.tracker.service_ms_per_step == pytest.approx(2.5)
        await until(pilot, lambda: "service CPU   2.50 ms/step" in str(
            app.query_one("#steps").render()), what="the service's CPU time a step")
        same_steps = msgspec.structs.replace(snapshot(1002.0, [req("a", 1, 42, 12)]),
                                             recent_steps=steps(504), service_cpu_ms=520.0)
        await show(pilot, app, pub, same_steps)  # no step ran: no figure, not 10 ms / 0
        assert app.tracker.service_ms_per_step is None
        older = msgspec.structs.replace(snapshot(1003.0, [req("a", 1, 43, 13)]),
                                        recent_steps=steps(508))  # service_cpu_ms None
        await show(pilot, app, pub, older)
        assert app.tracker.service_ms_per_step is None
        await until(pilot, lambda: "ms/step" not in str(app.query_one("#steps").render()),
                    what="the line to go")
        # A foreign publisher's NaN or infinity, steps running: no figure rather than "nan".
        for k, bad in enumerate((float("nan"), float("inf"))):
            for j, cpu in enumerate((600.0, bad)):
                snap = msgspec.structs.replace(snapshot(1004.0 + 2 * k + j, [req("a", 1, 44, 14)]),
                                               recent_steps=steps(512 + 8 * k + 4 * j),
                                               service_cpu_ms=cpu)
                await show(pilot, app, pub, snap)
            assert app.tracker.steps_per_s and app.tracker.service_ms_per_step is None, bad


async def test_a_restart_before_anything_finished_is_noticed(pub):
    app = make_app(pub.endpoint)
    async with app.run_test(size=SIZE) as pilot:
        # The first request of a fresh service: counters still 0.
        for i, t in enumerate((1000.0, 1001.0)):
            old = msgspec.structs.replace(snapshot(t, [req("first", 1, 40 + i, 10 + i)]),
                                          uptime_s=60.0 + i, recent_steps=steps(500 + 4 * i))
            await show(pilot, app, pub, old)
        assert "steps/s" in str(app.query_one("#steps").render())
        # Killed and started again: a new run, 2 s old, on its first steps.
        new = msgspec.structs.replace(snapshot(1010.0, []), uptime_s=2.0, recent_steps=steps(1))
        await show(pilot, app, pub, new)
        await pilot.pause(0.2)
        log = events_text(app)
        assert "the service restarted" in log
        assert "request first lost: the service restarted" in log and "ended (" not in log
        timing = str(app.query_one("#steps").render())
        assert "steps/s n/a" in timing and "-" not in timing.split("steps/s")[0][-12:], timing
        assert app.tracker.steps_per_s is None and app.tracker.worker_busy is None
