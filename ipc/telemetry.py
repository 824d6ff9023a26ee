"""The telemetry snapshot the service publishes a few times a second (one frame each, PUB).

Snapshots are whole states, not deltas, so a monitor that joins late or drops a frame is
right again at the next one.
"""

from __future__ import annotations

import msgspec

from ipc.client_messages import ReplicaStatus, WorkerState
from ipc.worker_messages import DecodeCompile

# A request's `text_tail` holds at most this many characters (the newest), so a snapshot stays
# small however long the outputs grow: at most 400 x the running and waiting requests.
TEXT_TAIL_CHARS = 400


class RequestTelemetry(msgspec.Struct, array_like=True, frozen=True):
    id: str
    slot: int  # 0 while waiting
    state: str  # "waiting" | "prefilling" | "decoding"
    prompt_len: int
    seq_len: int  # prompt + generated tokens
    generated: int
    last_accept_len: int  # draft tokens accepted by its last verify step (0 without speculation)
    age_s: float
    key: str  # service-wide request key ("<client hex>/<client id>"), for AdminAbort
    accept_length: float | None = None  # its mean tokens per verify step (accepted drafts + the
    # bonus token) so far; None without speculation or before its first verify step
    text_tail: str | None = None  # the last TEXT_TAIL_CHARS characters of the text streamed to
    # its client so far ("" before any); None from a service that does not publish text.
    replica: int = 0  # the data-parallel replica running it (parallel.dp)
    # array_like: new fields go last, with defaults, so older readers still decode.


class StepTelemetry(msgspec.Struct, array_like=True, frozen=True):
    step_id: int
    batch_size: int
    num_tokens: int  # tokens fed to the forward (prefill chunks + decodes)
    forward_ms: float  # worker time for the step
    wall_ms: float  # scheduler's view: plan sent to result processed
    idle_ms: float  # worker idle before this step (end of the previous forward to its start)


class SpecConfigTelemetry(msgspec.Struct, frozen=True):
    """The service's speculative decoding settings (its config's `[spec]` section)."""

    algorithm: str  # "eagle3" | "eagle"
    num_steps: int  # draft depth
    topk: int  # children per draft node; 1 = a chain
    num_draft_tokens: int  # tree nodes verified per step, the root included
    # decode batches above it run without drafting; 0: never; "auto": where measured faster
    disable_above_batch_size: int | str = 0


class WorkerTelemetry(msgspec.Struct, frozen=True):
    alive: bool  # state == "ready"
    pid: int | None  # while restarting, the replacement's
    restarts: int  # failed restart attempts included
    device: str
    dtype: str
    attention_backend: str
    state: WorkerState = "ready"
    decode_compile: DecodeCompile = "off"  # as in Stats


class TelemetrySnapshot(msgspec.Struct, tag="snapshot", frozen=True):
    time: float  # unix seconds
    uptime_s: float  # since the service started
    model: str
    overlap: bool
    speculation: bool
    running: list[RequestTelemetry]
    waiting: list[RequestTelemetry]
    free_pages: int
    total_pages: int
    page_size: int
    free_slots: int
    total_slots: int
    output_tokens_per_s: float  # over the last few seconds
    total_output_tokens: int
    finished_requests: int
    retractions: int
    recent_steps: list[StepTelemetry]  # newest last
    worker_idle_share: float  # worker idle / (idle + busy) since start: overlap efficiency
    worker: WorkerTelemetry
    # Speculative decoding, over all requests (defaults when speculation is off). A verify row
    # is one request in one step; its accept length is accepted drafts + 1 (the bonus token).
    spec_accept_length: float | None = None  # mean over the last 64 steps that verified drafts
    spec_verify_steps: int = 0  # verify rows since start
    spec_accept_rate_per_position: list[float] = []  # since start: share of verify rows that
    # accepted the draft token at depth i+1 (one entry per draft position; never increasing)
    spec_config: SpecConfigTelemetry | None = None  # the settings while speculation is on
    # Prefix cache (None / 0 when scheduling.prefix_cache is off): pages holding cached
    # prefixes (those nobody borrows are also in free_pages), and the share of admitted
    # requests' tokens served from it since start.
    prefix_cache_hit_share: float | None = None
    cached_pages: int = 0
    draining: bool = False  # shutting down: new requests refused, those in flight finishing
    # Each data-parallel replica's worker, batch and KV (one with parallel.dp = 1); the fields
    # above sum them (`worker`: alive while any replica serves, pid the first replica's).
    replicas: list[ReplicaStatus] = []
    # The service process's CPU time since it started, as in Stats (None: an older service)
    service_cpu_ms: float | None = None
