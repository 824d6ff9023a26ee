"""What clients read of a request's tokens: streamed text, stop strings, logprobs.

The SchedulerCore gives tokens and the ends it sees on tokens (eos, stop ids, length). Here each
token's text is decoded incrementally (service/detokenizer.py) and checked for stop strings
(service/stop_strings.py); a stop string that completes tells the caller after how many of the
output's tokens the request ends, and the caller ends it in the core, which frees its slot and
pages (service/scheduler.py does both). The last text of a request includes what was held back:
bytes of an unfinished character (as U+FFFD) and text that could have begun a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.sampling import SamplingParams
from ipc.telemetry import TEXT_TAIL_CHARS
from ipc.worker_messages import StepResult, unpack_f32, unpack_i32
from service.detokenizer import IncrementalDetokenizer
from service.request import FinishReason, RequestOutput, TokenLogprob, TokenOutput
from service.stop_strings import StopStringMatcher
from service.tokenizer import TextTokenizer


@dataclass
class StepLogprobs:
    """A step result's logprob arrays, one row per sampled token; empty where none was asked."""

    logprobs: np.ndarray | None
    top_ids: np.ndarray | None  # [rows, top_logprobs_n]
    top_logprobs: np.ndarray | None

    @classmethod
    def of(cls, result: StepResult) -> StepLogprobs:
        n_top = result.top_logprobs_n
        return cls(unpack_f32(result.logprobs) if result.logprobs else None,
                   unpack_i32(result.top_logprob_ids).reshape(-1, n_top) if n_top else None,
                   unpack_f32(result.top_logprobs).reshape(-1, n_top) if n_top else None)

    def of_rows(self, first: int, count: int, k: int | None) -> list[TokenLogprob] | None:
        """The logprobs of rows first..first+count with the k best alternatives (None: the
        request asked for none)."""
        if k is None or self.logprobs is None or count == 0:
            return None
        out = []
        for i in range(first, first + count):
            top = [] if self.top_ids is None or k == 0 else list(
                zip(self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()))
            out.append(TokenLogprob(float(self.logprobs[i]), top))
        return out


@dataclass
class _RequestText:
    params: SamplingParams
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    tail: str = ""  # the newest TEXT_TAIL_CHARS characters released (telemetry)


class OutputText:
    """The text state of every request in flight, by request id."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def open(self, rid: str, params: SamplingParams) -> None:
        self._requests[rid] = _RequestText(
            params, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True),
            StopStringMatcher(params.stop))

    def tail(self, rid: str) -> str:
        """The newest text released for a request in flight ("" for an unknown one)."""
        state = self._requests.get(rid)
        return "" if state is None else state.tail

    def push(self, out: TokenOutput) -> tuple[str, int | None]:
        """The text out's tokens release, and, when a stop string completes, after how many of
        them the request ends (None: it does not end on a stop string)."""
        state = self._requests[out.rid]
        if out.finish_reason is None and len(out.token_ids) == 1 and not state.stops.stops:
            # Most outputs: one token that ends nothing, no stop string to look for.
            text = state.detok.push(out.token_ids[0])
            if text:
                state.tail = (state.tail + text)[-TEXT_TAIL_CHARS:]
            return text, None
        params = state.params
        n_before = out.completion_tokens - len(out.token_ids)
        text = ""
        for i, token in enumerate(out.token_ids):
            # Only the core's last token can carry its end; STOP there means a stop token,
            # whose text is not output.
            end = out.finish_reason if i == len(out.token_ids) - 1 else None
            piece = "" if end == FinishReason.STOP else state.detok.push(token)
            if end is not None:
                piece += state.detok.flush()
            # Before min_new_tokens a stop string ends nothing, so its text must be streamed.
            piece, hit = state.stops.push(piece, can_stop=n_before + i + 1 >= params.min_new_tokens)
            if end is not None and not hit:
                piece += state.stops.flush()
            text += piece
            if hit:
                state.tail = (state.tail + text)[-TEXT_TAIL_CHARS:]
                return text, i + 1
        state.tail = (state.tail + text)[-TEXT_TAIL_CHARS:] if text else state.tail
        return text, None

    def output(self, out: TokenOutput, text: str, logprobs: StepLogprobs | None) -> RequestOutput:
        """out as clients get it; a request that ended is forgotten here."""
        state = self._requests.pop(out.rid) if out.finished else self._requests[out.rid]
        lps = None if logprobs is None else logprobs.of_rows(
            out.result_row, len(out.token_ids), state.params.logprobs)
        if not out.finished:
            return RequestOutput(out.rid, out.token_ids, text, lps)
        return RequestOutput(out.rid, out.token_ids, text, lps, out.finish_reason,
                             out.prompt_tokens, out.completion_tokens, out.error,
                             out.spec_verify_steps, out.spec_accepted_drafts,
                             out.spec_accepted_per_position)
