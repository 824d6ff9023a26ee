"""A worker that breaks the protocol: the instant worker (fmserve/bench/instant_worker.py),
but each result leaves out the last row its plan asked for (tests/service/
test_worker_protocol.py). Run as `python -m tests.service.lossy_worker`, like a worker."""

from __future__ import annotations

import sys

import fmserve.bench.instant_worker as instant
from ipc.worker_messages import StepResult, pack_i32, unpack_i32


def result_without_its_last_row(**fields) -> StepResult:
    fields["slots"] = pack_i32(unpack_i32(fields["slots"])[:-1])
    fields["token_ids"] = pack_i32(unpack_i32(fields["token_ids"])[:-1])
    return StepResult(**fields)


if __name__ == "__main__":
    instant.StepResult = result_without_its_last_row
    sys.exit(instant.main())
