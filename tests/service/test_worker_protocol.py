"""A worker's result must answer every row its plan asked for: one that leaves a request out
is a protocol error (the worker is killed and the step's requests fail, as for a wrong step
id), never a request that waits forever. Real processes speaking the worker protocol: the
bench's instant worker and a lossy copy of it (tests/service/lossy_worker.py)."""

from __future__ import annotations

import pytest

import service.worker_spawn as worker_spawn
from ipc.worker_config import worker_config
from ipc.worker_messages import StepPlan, pack_i32, unpack_i32
from service.worker_supervisor import WorkerDied, WorkerHandle

PLAN = StepPlan(step_id=1, new_requests=[], grants=[], extends=[],
                decode_slots=pack_i32([1, 2]), released_slots=b"")


@pytest.fixture
def anyio_backend():
    return "asyncio"  # zmq.asyncio needs asyncio


async def started(gguf_path, monkeypatch, module: str) -> WorkerHandle:
    monkeypatch.setattr(worker_spawn, "WORKER_MODULE", module)
    handle = WorkerHandle(worker_config(model_path=str(gguf_path), dtype="fp32",
                                        max_kv_tokens=4096, max_running_requests=8))
    await handle.start()
    return handle


@pytest.mark.anyio
async def test_a_result_answering_every_planned_row_is_taken(gguf_path, monkeypatch):
    handle = await started(gguf_path, monkeypatch, "fmserve.bench.instant_worker")
    try:
        await handle.send_plan(PLAN)
        result = await handle.next_result()
        assert result.step_id == 1 and unpack_i32(result.slots).tolist() == [1, 2]
        assert handle.alive and handle.num_inflight == 0
    finally:
        await handle.stop()


@pytest.mark.anyio
async def test_a_result_that_leaves_a_planned_request_out_kills_the_worker(gguf_path,
                                                                          monkeypatch):
    handle = await started(gguf_path, monkeypatch, "tests.service.lossy_worker")
    try:
        await handle.send_plan(PLAN)
        with pytest.raises(WorkerDied, match="protocol error: expected the result of step 1, "
                           "the worker sent StepResult 1 for other requests; it was killed"):
            await handle.next_result()
        assert not handle.alive
    finally:
        await handle.stop()
