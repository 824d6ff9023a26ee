"""A service restarted under a running `fmserve top` before it had finished anything: the
monitor took the restart for nothing (it looked only for counters going back, and they were
0), reported the lost requests as ended normally, and drew a negative steps/s and worker busy
share from step ids that started again at 1."""

from __future__ import annotations

import msgspec
import pytest

from ipc.telemetry import StepTelemetry
from tests.test_tui import SIZE, events_text, make_app, pub, req, show, snapshot  # noqa: F401

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def steps(first: int) -> list[StepTelemetry]:
    return [StepTelemetry(step_id=first + i, batch_size=1, num_tokens=1, forward_ms=20.0,
                          wall_ms=25.0, idle_ms=1.0) for i in range(4)]


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
