"""Shared by the engine tests: run chats through an offline Engine, check what every scenario
must leave behind (exactly one terminal output per request, empty accounting), and read the
logits at every position of a prompt through the worker's paged path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from ipc.worker_messages import ExtendEntry, NewRequest, PageGrant, StepPlan, pack_i32


@dataclass
class RequestRun:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    verify_steps: int = 0  # speculative decoding counters (0 without speculation)
    accepted_drafts: int = 0

    @property
    def visible(self) -> tuple:
        """What a client sees: tokens, text, finish reason."""
        return (self.token_ids, self.text, self.finish_reason)


def assert_accounting_empty(engine: Engine) -> None:
    acc = engine.scheduler.accounting()
    assert acc["free_pages"] == acc["total_pages"], acc
    assert acc["free_slots"] == acc["total_slots"], acc
    assert acc["running"] == acc["waiting"] == 0, acc


def run_requests(engine: Engine, chats: list, params: list[SamplingParams], overlap: bool,
                 abort_index: int | None = None, abort_after: int = 4) -> list[RequestRun]:
    """Run the chats as one continuous batch. Request `abort_index` is aborted through the
    scheduler once it has streamed at least `abort_after` tokens and not finished."""
    engine.overlap = overlap
    submitted = engine.submit(chats, params)
    runs = {rid: RequestRun() for rid, _ in submitted}
    terminal = {rid: 0 for rid, _ in submitted}
    victim = submitted[abort_index][0] if abort_index is not None else None
    for out in engine.run():
        r = runs[out.rid]
        r.token_ids += out.token_ids
        r.text += out.text
        if out.finished:
            r.finish_reason = out.finish_reason.value
            r.verify_steps, r.accepted_drafts = out.spec_verify_steps, out.spec_accepted_drafts
            terminal[out.rid] += 1
        if out.rid == victim and not out.finished and len(r.token_ids) >= abort_after:
            r.finish_reason = engine.scheduler.abort(victim).finish_reason.value
            terminal[victim] += 1
            victim = None
    assert all(n == 1 for n in terminal.values()), terminal  # exactly one terminal each
    assert_accounting_empty(engine)
    return [runs[rid] for rid, _ in submitted]


def prompt_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the worker's paged path."""
    worker = engine.worker
    page = worker.state.kv_pool.page_size
    pages = list(range(1, 1 + -(-len(ids) // page)))
    plan = StepPlan(step_id=0, new_requests=[NewRequest(1, SamplingParams())],
                    grants=[PageGrant(1, 0, pack_i32(pages))],
                    extends=[ExtendEntry(1, 0, pack_i32(ids), True)],
                    decode_slots=b"", released_slots=b"")
    _, hidden, _ = worker.step.forward(plan)
    worker.run_step(StepPlan(1, [], [], [], b"", pack_i32([1])))  # forget slot 1 again
    return worker.state.model.logits(hidden)
