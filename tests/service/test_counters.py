"""ServiceCounters (service/counters.py): what Stats says of the worker's compiled decode step."""

from __future__ import annotations

import msgspec

from ipc.worker_messages import StepPlan, StepResult
from service.counters import ServiceCounters
from tests.service.fake_scheduler import fake_info, make_core

PLAN = StepPlan(step_id=1, new_requests=[], grants=[], extends=[], decode_slots=b"", released_slots=b"")


def result(decode_compile: str) -> StepResult:
    return StepResult(1, b"", b"", b"", 0, b"", b"", 1.0, decode_compile=decode_compile)


def test_stats_say_the_ready_workers_compile_state_until_a_step_says_another():
    counters, core = ServiceCounters(), make_core()
    info = msgspec.structs.replace(fake_info(), decode_compile="building")

    def stats():
        return counters.stats(core.accounting(), info, "ready", "i", 0, False, []).decode_compile

    assert stats() == "building"  # no step yet: WorkerReady's info
    counters.record_step(PLAN, result("building"), 0.0, False)
    assert stats() == "building"
    counters.record_step(PLAN, result("on"), 0.0, False)
    assert stats() == "on"
    counters.decode_compile = None  # a restarted worker (service/worker_recovery.py)
    assert stats() == "building"
