"""A request's life inside the scheduler, and what the scheduler emits for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ipc.sampling import SamplingParams
from ipc.spec_settings import accept_length
from service.spec_stats import count_accepted


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, owns no slot or pages
    PREFILLING = "prefilling"  # owns a slot; prompt chunks still to run
    DECODING = "decoding"  # prompt done, produces one token per step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # the client asked, or vanished
    ERROR = "error"  # the worker failed


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    borrowed: list = field(default_factory=list)  # prefix-cache blocks its first pages are
    num_cached: int = 0  # tokens whose KV is in the cache
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_inflight: int = 0  # planned samples whose result has not been processed yet
    # Speculative decoding: verify steps, accepted drafts, and acceptance per draft position.
    spec_verify_steps: int = 0
    spec_accepted_drafts: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    last_accept_len: int = 0  # draft tokens accepted by the last verify step

    def record_accept(self, accepted: int) -> None:
        """A verify step emitted accepted + 1 tokens."""
        self.last_accept_len = accepted
        self.spec_verify_steps += 1
        self.spec_accepted_drafts += accepted
        count_accepted(self.spec_accepted_per_position, accepted)

    def drop_accepted(self, dropped: int) -> None:
        """The last verify step emitted `dropped` tokens fewer: a stop string ended it."""
        kept = self.last_accept_len - dropped
        count_accepted(self.spec_accepted_per_position, self.last_accept_len, -1, kept)
        self.spec_accepted_drafts -= dropped
        self.last_accept_len = kept

    @property
    def spec_accept_length(self) -> float | None:
        """Mean tokens per verify step (accepted drafts + the bonus token)."""
        return accept_length(self.spec_accepted_drafts, self.spec_verify_steps)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class TokenOutput:
    """What the SchedulerCore made of one step for one request: new tokens, maybe its end.
    service/output_text.py turns it into a RequestOutput (text, logprobs)."""

    rid: str
    token_ids: list[int]
    result_row: int = 0  # the step result's row of token_ids[0] (where its logprobs are)
    finish_reason: FinishReason | None = None  # STOP with tokens: the last is a stop token
    prompt_tokens: int = 0
    completion_tokens: int = 0  # the request's output tokens so far, these included
    error: str | None = None
    spec_verify_steps: int = 0  # set when it ends, as in RequestOutput
    spec_accepted_drafts: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty unless asked


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens (and their text), maybe its end."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    spec_verify_steps: int = 0  # set on the terminal output when the request speculated
    spec_accepted_drafts: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # verify steps that
    # accepted the draft at depth i+1, one entry per draft position

    @property
    def spec_accept_length(self) -> float | None:
        """Mean tokens per verify step (accepted drafts + the bonus token)."""
        return accept_length(self.spec_accepted_drafts, self.spec_verify_steps)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
