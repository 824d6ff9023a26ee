"""Client <-> service messages (msgpack over a ZMQ DEALER/ROUTER pair).

Every frame is one msgpack map with a "type" tag. A client sends `Generate`, `Abort`, `Health`
or `Ping`; the service answers a `Generate` with zero or more `Chunk`s and exactly one terminal
message, `Finished` or `Error`. Unknown fields are refused (`forbid_unknown_fields`), so a typo
in a request is an error, not a silently ignored option.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ipc.sampling import SamplingParams
from ipc.worker_messages import DecodeCompile

MAX_MESSAGE_BYTES = 8 << 20  # larger frames are refused with Error(code="message_too_large")
# "restarting": a replacement worker is loading (requests wait in the queue meanwhile);
# "down": restarts are spent and new requests get Error(code="worker_unavailable").
WorkerState = Literal["ready", "restarting", "down"]


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str  # "system", "user" or "assistant"
    content: str


class Generate(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    """Start a request. Exactly one of text, token_ids, messages must be given."""

    id: str  # chosen by the client, unique among its requests in flight
    text: str | None = None  # plain text, encoded with the model's BOS where it adds one
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # rendered with the model's chat template
    params: SamplingParams = SamplingParams()
    stream: bool = True  # False: one Chunk with all tokens right before Finished


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    id: str


class Health(msgspec.Struct, tag="health", frozen=True, forbid_unknown_fields=True):
    """Ask for the service's state; answered with `Stats`."""


class Ping(msgspec.Struct, tag="ping", frozen=True, forbid_unknown_fields=True):
    """Client heartbeat; answered with `Pong`. Any message counts as a sign of life."""


class AdminAbort(msgspec.Struct, tag="admin_abort", frozen=True, forbid_unknown_fields=True):
    """Abort any client's request (for monitors such as `fmserve top`). `key` is the
    service-wide request key from telemetry (`RequestTelemetry.key`); `token` the service's
    admin token (`Error(code="forbidden")` without the right one). The owner gets its usual
    `Finished(reason="abort")`; the sender gets `Aborted` (or `Error` if unknown)."""

    key: str
    token: str = ""


# Where the service and its admin clients (fmserve top) read the admin token from.
ADMIN_TOKEN_ENV = "FMSERVE_ADMIN_TOKEN"


ClientRequest = Generate | Abort | Health | Ping | AdminAbort


class Chunk(msgspec.Struct, tag="chunk", frozen=True):
    id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None  # one per token, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None = None  # arrival to first token
    e2e_ms: float | None = None  # arrival to finish
    # Speculative decoding; zero, None and [] when the request did not speculate. A verify step
    # is one target forward over the request's draft tree: it accepts 0..depth draft tokens and
    # adds one token of its own (the bonus).
    spec_verify_steps: int = 0
    spec_accepted_drafts: int = 0
    spec_accept_length: float | None = None  # tokens per verify step: (accepted + steps) / steps
    spec_accepted_per_position: list[int] = []  # verify steps that accepted draft depth i+1


class Finished(msgspec.Struct, tag="finished", frozen=True):
    id: str
    reason: str  # "stop" | "length" | "abort"
    usage: Usage


class Error(msgspec.Struct, tag="error", frozen=True):
    """A request failed (id set) or a frame could not be understood (id may be None)."""

    id: str | None
    code: str  # machine-readable: "invalid_message", "invalid_params", "prompt_too_long", ...
    message: str  # for people: what was wrong and what to do


class ReplicaStatus(msgspec.Struct, frozen=True):
    """One data-parallel replica (parallel.dp): a worker group with its own KV pages, slots and
    batch. `Stats` and telemetry carry one per replica (one with dp = 1)."""

    index: int
    worker_state: WorkerState
    pid: int | None  # its worker process (rank 0 of its group); None while none runs
    restarts: int  # of this replica's worker, failed attempts included
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    steps: int
    standby_pid: int | None = None  # the process started ahead for its next restart (worker.standby)
    # With parallel.dp_attention each attention rank is one entry (pid: the group's rank 0):
    # the steps it ran as an idle batch (no request of its own while another rank had some),
    # and its target and draft forwards of zero tokens. 0 elsewhere.
    idle_steps: int = 0
    idle_forwards: int = 0


class Stats(msgspec.Struct, tag="stats", frozen=True):
    model: str
    device: str
    worker_alive: bool  # worker_state == "ready"
    running: int
    waiting: int
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    steps: int
    output_tokens: int
    worker_busy_ms: float = 0.0  # summed step time in the worker since start
    worker_idle_ms: float = 0.0  # summed worker idle between steps while work was queued
    # Prefix cache (scheduling.prefix_cache; 0 when off): pages holding cached prefixes (those
    # nobody borrows count in free_pages too), and prompt tokens served from it since start.
    cached_pages: int = 0
    prefix_cache_hit_tokens: int = 0
    instance: str = ""  # as in Pong; "" from an older service
    worker_state: WorkerState = "ready"
    worker_restarts: int = 0  # since the service started, failed restart attempts included
    draining: bool = False  # shutting down: new requests refused, those in flight finishing
    # Per replica; the fields above sum them (worker_state: "ready" while any replica serves).
    replicas: list[ReplicaStatus] = []
    # The worker's compiled decode step as of its last step (ipc/worker_messages.py)
    decode_compile: DecodeCompile = "off"
    # The service process's CPU time since it started, all its threads (scheduling, replies,
    # ZMQ's I/O threads, HTTP): per step, what a step costs this side of the worker.
    service_cpu_ms: float = 0.0


class Pong(msgspec.Struct, tag="pong", frozen=True, omit_defaults=True):
    # This run of the service, new at every start: a client that sees it change knows the
    # requests it has in flight were lost with the old run. "" from an older service.
    instance: str = ""


class Aborted(msgspec.Struct, tag="aborted", frozen=True):
    """Answer to `AdminAbort`: the request with this key has been ended."""

    key: str


ServiceReply = Chunk | Finished | Error | Stats | Pong | Aborted
