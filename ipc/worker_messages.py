"""Scheduler <-> worker messages: one plan per step in, one result per step out.

Hot messages are `array_like` (encoded as msgpack arrays, no field names on the wire) and carry
token arrays as raw little-endian buffers (`bytes` of int32/float32), not lists. A request's
prompt chunk and sampling params travel once; a running request is referenced by its slot.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from ipc.sampling import SamplingParams

WORKER_PROTOCOL_VERSION = 2  # 2: GroupPlan / GroupResult (DP attention)
# The compiled decode step (gpu/compiled_decode.py): "off" (decode steps run eagerly), "building"
# (compiled on a thread; eager meanwhile), "on" (in use), "failed" (eager; the worker log says
# why), "native" (small decode batches run the decoder in C instead: gpu/cpu_decode_step.py)
DecodeCompile = Literal["off", "building", "on", "failed", "native"]


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")


class NewRequest(msgspec.Struct, array_like=True, frozen=True):
    """A request entering a slot: the worker resets the slot's sampling state."""

    slot: int
    params: SamplingParams
    # Position of the request's first output token. A request resumed after a retraction
    # prefills its earlier outputs too; from here on its prefill counts as generated (penalties,
    # min_new_tokens), as it did before. -1: the prefill is all prompt.
    output_start: int = -1
    # int32: its first tokens when it borrows their KV from the prefix cache (no prefill chunk
    # carries them); sent only to a request with penalties, which must see them.
    cached_ids: bytes = b""


class PageGrant(msgspec.Struct, array_like=True, frozen=True):
    """The request in `slot` owns `pages` as its page number first_page_index, +1, ..."""

    slot: int
    first_page_index: int
    pages: bytes  # int32


class ExtendEntry(msgspec.Struct, array_like=True, frozen=True):
    """A prefill chunk: tokens at positions prefix_len .. prefix_len + len(token_ids) - 1."""

    slot: int
    prefix_len: int
    token_ids: bytes  # int32
    sample: bool  # the chunk ends the prompt: sample the first output token from it
    next_token: int = -1  # the prompt token after the chunk (-1 when sample): EAGLE's draft
    # extend pairs position t with token t + 1, so a non-final chunk needs one token lookahead


class StepPlan(msgspec.Struct, tag="plan", array_like=True, frozen=True):
    """One forward. Decode entries carry only slots: the worker reads each request's input
    token from its output buffer and its length from its length buffer (the FutureMap shape)."""

    step_id: int
    new_requests: list[NewRequest]
    grants: list[PageGrant]
    extends: list[ExtendEntry]
    decode_slots: bytes  # int32
    released_slots: bytes  # int32: slots freed since the last plan


class StepResult(msgspec.Struct, tag="result", array_like=True, frozen=True):
    """Sampled tokens, in plan order: extends that sample, then decodes.

    Without speculation every row emits one token. With it, `accept_lens[row]` is the number of
    accepted draft tokens of a verify row (-1 for a prefill row), and the row emits
    accept_lens + 1 tokens (the accepted drafts, then the bonus token), concatenated in
    `token_ids` row after row."""

    step_id: int
    slots: bytes  # int32, one per row
    token_ids: bytes  # int32, one per emitted token
    logprobs: bytes  # float32, empty when no request in the step asked for logprobs
    top_logprobs_n: int  # columns of the two arrays below (0 = none)
    top_logprob_ids: bytes  # int32 [len(slots) * top_logprobs_n]
    top_logprobs: bytes  # float32 [len(slots) * top_logprobs_n]
    forward_ms: float  # plan received to result ready
    idle_ms: float = 0.0  # end of the previous step to the start of this one (worker idle)
    accept_lens: bytes = b""  # int32 per row; empty when the worker does not speculate
    decode_compile: DecodeCompile = "off"  # as this step was launched


class WorkerInfo(msgspec.Struct, frozen=True):
    """What the scheduler must know about a worker's capacity and model."""

    protocol_version: int
    model_name: str
    device: str
    dtype: str
    attention_backend: str
    num_layers: int
    vocab_size: int
    max_context_len: int
    page_size: int
    num_pages: int  # including the reserved page 0
    num_slots: int  # including the reserved slot 0
    eos_token_ids: list[int]
    spec_algorithm: str = "none"
    spec_num_steps: int = 0
    spec_reserve_tokens: int = 0  # KV room to grant beyond a running request's known length
    decode_compile: DecodeCompile = "off"  # at ready; each StepResult says it since


class WorkerReady(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    """First message of a worker, after its model is loaded."""

    info: WorkerInfo


class WorkerFailed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """The worker could not start or could not run a step; it exits after sending this."""

    step_id: int | None
    message: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    """Scheduler -> worker: finish and exit."""


class GroupPlan(msgspec.Struct, tag="group_plan", array_like=True, frozen=True):
    """DP attention (parallel.dp_attention): one step of the whole worker group, a StepPlan per
    attention rank (an empty one runs that rank's idle batch). Rank 0 relays it to the others;
    each runs `plans[rank]`, and rank 0 answers one GroupResult."""

    step_id: int
    plans: list[StepPlan]


class RankResult(msgspec.Struct, array_like=True, frozen=True):
    """One attention rank's part of a GroupResult."""

    result: StepResult
    idle_steps: int  # this step ran as an idle batch on the rank (0 or 1)
    idle_forwards: int  # its target and draft forwards of zero tokens in this step


class GroupResult(msgspec.Struct, tag="group_result", array_like=True, frozen=True):
    """Every rank's result of a GroupPlan, in rank order."""

    step_id: int
    results: list[RankResult]


SchedulerToWorker = StepPlan | GroupPlan | Shutdown
WorkerToScheduler = StepResult | GroupResult | WorkerReady | WorkerFailed


def planned_slots(plan: StepPlan | GroupPlan) -> list[bytes]:
    """The slots a plan's result must answer, in order, per attention rank (one rank without
    DP attention): the extends that sample, then the decodes, as `StepResult.slots` has them."""
    if isinstance(plan, GroupPlan):
        return [planned_slots(p)[0] for p in plan.plans]
    return [pack_i32([e.slot for e in plan.extends if e.sample]) + plan.decode_slots]


def answered_slots(result: StepResult | GroupResult) -> list[bytes]:
    """The slots a result answers, per attention rank (to set beside `planned_slots`)."""
    if isinstance(result, GroupResult):
        return [r.result.slots for r in result.results]
    return [result.slots]
