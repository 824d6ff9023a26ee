"""What each rank of tests/gpu/test_dp_attention.py does, in a process of its own
(torch.multiprocessing spawn, gloo over loopback, one torch thread): a Worker with
parallel.dp_attention running ITS OWN list of plans in lockstep with the other ranks (an
empty plan where it has no request that step), under a bounded collective timeout so a rank
that misses a collective fails the run instead of hanging it. Also the plans themselves and
the one-rank reference run."""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from fmserve.default_model import resolve_draft_model
from gpu.worker import Worker
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from ipc.worker_config import worker_config
from ipc.worker_messages import ExtendEntry, NewRequest, PageGrant, StepPlan, pack_i32, unpack_i32

# The default model's tokens of "The capital of France is" and "Write a haiku about rain. The
# rain falls": prompts of different lengths, so the ranks' MLP gathers pad.
PROMPT_A = [504, 3575, 282, 4649, 314]
PROMPT_B = [19161, 253, 421, 30614, 563, 5249, 30, 378, 5249, 8227]
PAGE_SIZE = 16
PAGES = [1, 2, 3, 4]  # 64 tokens: a prompt and a few EAGLE verify steps with room to spare
SLOT = 1  # every rank has a pool of its own: both use slot 1


def config(model_path: str, spec: SpecSettings | None = None, tp: int = 1,
           dp_attention: bool = False):
    if spec is not None:
        spec = msgspec.structs.replace(spec, draft_model=str(resolve_draft_model(
            spec.algorithm, "", model_path)))
    return worker_config(model_path=model_path, dtype="fp32", attention_backend="torch",
                         page_size=PAGE_SIZE, max_kv_tokens=256, max_running_requests=2,
                         worker_cpu_threads=1, progress=False, spec=spec, tp=tp,
                         dp_attention=dp_attention)


def empty_plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, [], [], [], pack_i32([]), pack_i32([]))


def request_plans(prompt: list[int], start: int, steps: int, slot: int = SLOT,
                  pages: list[int] = PAGES) -> list[StepPlan]:
    """`steps` plans of one greedy request in `slot`: empty before step `start`, then its
    prefill, then decodes."""
    plans = []
    for k in range(steps):
        if k < start:
            plans.append(empty_plan(k))
        elif k == start:
            plans.append(StepPlan(k, [NewRequest(slot, SamplingParams(temperature=0.0))],
                                  [PageGrant(slot, 0, pack_i32(pages))],
                                  [ExtendEntry(slot, 0, pack_i32(prompt), True)],
                                  pack_i32([]), pack_i32([])))
        else:
            plans.append(StepPlan(k, [], [], [], pack_i32([slot]), pack_i32([])))
    return plans


def merged(a: list[StepPlan], b: list[StepPlan]) -> list[StepPlan]:
    """Two requests' plans as one rank's: each step both requests' entries."""
    return [StepPlan(x.step_id, x.new_requests + y.new_requests, x.grants + y.grants,
                     x.extends + y.extends,
                     pack_i32([*unpack_i32(x.decode_slots), *unpack_i32(y.decode_slots)]),
                     pack_i32([])) for x, y in zip(a, b)]


def is_empty(plan: StepPlan) -> bool:
    return not plan.extends and not len(unpack_i32(plan.decode_slots))


def tokens_of(worker: Worker, plans: list[StepPlan], skip_empty: bool = False) -> list[int]:
    """Every token the plans' steps emit, in order."""
    out: list[int] = []
    for plan in plans:
        if not (skip_empty and is_empty(plan)):
            out += unpack_i32(worker.run_step(plan).token_ids).tolist()
    return out


def one_rank(model_path: str, spec: SpecSettings | None, plans: list[StepPlan]) -> list[int]:
    """The reference: one rank, no DP attention, the same plans."""
    return tokens_of(Worker(config(model_path, spec)), plans)


def rank_main(rank: int, world: int, port: int, model_path: str, runs: list[dict],
              timeout_s: float, out_dir: str) -> None:
    """Each run: {"spec", "plans" (one list per rank), "skip_empty" (ranks that skip their
    empty plans and then stay silent: a bug on purpose)} on a fresh worker. Saves, per run,
    this rank's tokens, idle counts, forwards, cut and the error that stopped it (or None)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    results = []
    try:
        for run in runs:
            worker = Worker(config(model_path, run["spec"], world, dp_attention=True))
            found = {"tokens": [], "error": None}
            skips = rank in run.get("skip_empty", ())
            try:
                found["tokens"] = tokens_of(worker, run["plans"][rank], skip_empty=skips)
                if skips:  # stay in the group, answering nothing, past the partner's timeout
                    time.sleep(timeout_s + 2)
            except Exception:
                found["error"] = traceback.format_exc()
            found["idle"] = dict(worker.state.idle_counts)
            found["forwards"] = worker.state.dp_attention.forwards
            found["kv_heads"] = worker.state.kv_pool.num_kv_heads
            found["intermediate"] = worker.state.model.config.intermediate_size
            results.append(found)
            if found["error"]:
                break
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()

