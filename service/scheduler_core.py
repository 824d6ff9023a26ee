"""Continuous batching, free of I/O: requests in, step plans out, step results in, tokens out.

The service drives it from its anyio loop and the offline engine from a plain loop; both send
the plans to the same `ModelRunner`. Policy, in the spirit of SGLang's scheduler:
- FCFS waiting queue; a request is admitted when a slot is free and the KV pages for its whole
  prompt are free (plus one page of headroom), never by skipping the queue head;
- every step decodes all running requests, then spends what is left of the token budget on
  prefill chunks (continuing partial prefills first, then admitting new requests);
- when decode growth runs out of pages, the most recently admitted request is retracted (its
  pages and slot freed) and later recomputed from its prompt plus what it had generated;
- with `prefix_cache`, a request that lets go of its pages leaves its full, computed ones in a
  PrefixCache (service/prefix_cache.py), and a new one starts from the longest cached prefix
  of its tokens; unborrowed cached pages count as free and are taken back when wanted.
The core ends requests on tokens (eos, stop ids, length) and frees what they hold; their text
and stop strings are service/output_text.py's, which ends a request here through
`end_at_stop_string` (service/scheduler.py joins the two).
"""

from __future__ import annotations

import time

import numpy as np
from collections import deque
from dataclasses import dataclass

from ipc.sampling import SamplingParams
from ipc.worker_messages import (ExtendEntry, NewRequest, PageGrant, StepPlan, StepResult,
                                 WorkerInfo, pack_i32, unpack_i32)
from service.kv_accounting import PageAllocator, SlotAllocator
from service.prefix_cache import PrefixCache
from service.request import FinishReason, Request, RequestState, TokenOutput
from service.spec_stats import SpecAcceptStats, count_accepted


class RequestRejected(ValueError):
    """The request can never run here (too long, bad params, duplicate id)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SchedulerConfig:
    max_tokens_per_step: int = 2048  # decode tokens + prefill chunk tokens per forward
    max_running_requests: int | None = None  # None: every slot the worker has
    prefix_cache: bool = False  # reuse the KV pages of earlier requests' shared prefixes


class SchedulerCore:
    def __init__(self, info: WorkerInfo, cfg: SchedulerConfig) -> None:
        if cfg.max_tokens_per_step < 1:
            raise ValueError("max_tokens_per_step must be >= 1")
        self.info = info
        self.cfg = cfg
        self.pages = PageAllocator(info.num_pages, info.page_size)
        self.prefix_cache = PrefixCache(info.page_size) if cfg.prefix_cache else None
        num_slots = info.num_slots if cfg.max_running_requests is None else min(
            info.num_slots, cfg.max_running_requests + 1)
        self.slots = SlotAllocator(num_slots)
        # The longest a request may grow (prompt + output), past which it ends with "length":
        # the context, and what the KV cache holds for one request beside admission's page of
        # headroom and speculation's reserve. A request retracted any longer could never be
        # admitted again, and would block the waiting queue's head for good.
        self.max_seq_len = min(info.max_context_len, (self.pages.capacity - 1) * info.page_size
                               - info.spec_reserve_tokens)
        self.eos_ids = frozenset(info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request, in admission order
        self.requests: dict[str, Request] = {}
        self._released: list[int] = []
        # step id -> slot -> (request, its retraction count when planned). With overlap two
        # plans are in flight; an entry is stale if the request finished or was retracted since.
        self._inflight: dict[int, dict[int, tuple[Request, int]]] = {}
        self._planning: dict[int, tuple[Request, int]] = {}
        self.step_id = 0
        self.num_retractions = 0  # lifetime count, for telemetry and tests
        self.num_stale_results = 0  # results dropped one step late (finished/aborted/retracted)
        self.spec_stats = SpecAcceptStats(num_positions=info.spec_num_steps)  # all requests

    # -- requests in ------------------------------------------------------------------------

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        # Messages never quote `rid`: in the service it is an internal key holding the client's
        # identity, and the error reaches the client with its own id anyway.
        if rid in self.requests:
            raise RequestRejected("duplicate_id", "a request with this id is already in flight")
        try:
            params.validate(self.info.vocab_size)
        except ValueError as exc:
            raise RequestRejected("invalid_params", str(exc)) from None
        if not prompt_ids:
            raise RequestRejected("invalid_prompt", "the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise RequestRejected("invalid_prompt", f"prompt token id {bad[0]} is outside the "
                                  f"vocabulary 0..{self.info.vocab_size - 1}")
        limit = self.info.max_context_len
        if len(prompt_ids) >= limit:
            raise RequestRejected("prompt_too_long", f"the prompt has {len(prompt_ids)} tokens; "
                                  f"the context holds {limit}, so it must be shorter than that")
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestRejected("prompt_too_long", f"the prompt has {len(prompt_ids)} tokens; "
                                  f"the KV cache holds {self.max_seq_len} for one request, so "
                                  f"it must be shorter than that")
        req = Request(rid=rid, prompt_ids=list(prompt_ids), params=params)
        self.requests[rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> TokenOutput | None:
        """End a request now. Returns its terminal output, or None if the id is unknown."""
        req = self.requests.get(rid)
        if req is None:
            return None
        if req.state == RequestState.WAITING:
            self.waiting.remove(req)
        return self._finish(req, FinishReason.ABORT)

    def fail_all(self, message: str) -> list[TokenOutput]:
        """The worker died: every request ends with an error; accounting returns to empty."""
        outs = [self._finish(req, FinishReason.ERROR, error=message)
                for req in list(self.requests.values())]
        if self.prefix_cache is not None:  # the next worker starts with an empty KV pool
            self.pages.free(self.prefix_cache.evict(self.prefix_cache.num_blocks))
            assert self.prefix_cache.num_blocks == 0, "a cached block still borrowed"
        self.waiting.clear()
        self._inflight.clear()
        self._released.clear()
        return outs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- plans out --------------------------------------------------------------------------

    def plan_step(self) -> StepPlan | None:
        new_requests: list[NewRequest] = []
        grants: list[PageGrant] = []
        extends: list[ExtendEntry] = []
        decode_slots: list[int] = []
        self._planning = {}

        for req in self._decoding_requests():
            if req.state != RequestState.DECODING:
                continue  # retracted to make room for an older request this very step
            if self._will_finish_by_length(req):
                continue  # its in-flight step hits the limit: a decode now would be wasted
            # Without speculation the request's last output token enters the cache at position
            # num_cached. With it the length is known only up to the last processed result:
            # grant the room a verify tree and its drafts may need, twice (one step in flight).
            reserve = self.info.spec_reserve_tokens
            need = req.num_cached + 1 if not reserve else req.seq_len + reserve
            if not self._grow(req, need, grants):
                continue  # req itself was retracted to make room
            decode_slots.append(req.slot)
            self._mark_sampling(req)
            req.num_cached = req.num_cached + 1 if not reserve else req.seq_len
        budget = self.cfg.max_tokens_per_step - len(decode_slots)

        for req in [r for r in self.running.values() if r.state == RequestState.PREFILLING]:
            if budget <= 0:
                break
            budget -= self._plan_chunk(req, budget, grants, extends)

        while budget > 0 and self.waiting:
            req = self.waiting[0]
            borrowed = self._borrow_prefix(req)
            need = self.pages.pages_for(req.seq_len + 1) + 1 - len(borrowed)
            if self.slots.num_free == 0 or self._num_free_pages() < need:
                if self.prefix_cache is not None:
                    self.prefix_cache.give_back(borrowed)
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.state = RequestState.PREFILLING
            self.running[req.slot] = req
            cached_ids = b""
            if borrowed:  # its first pages hold the KV of its first tokens already
                req.borrowed = borrowed
                req.pages = [b.page for b in borrowed]
                req.num_cached = len(borrowed) * self.pages.page_size
                grants.append(PageGrant(req.slot, 0, pack_i32(req.pages)))
                if req.params.has_penalties:
                    cached_ids = pack_i32(req.all_ids[:req.num_cached])
            new_requests.append(NewRequest(req.slot, req.params, len(req.prompt_ids),
                                           cached_ids))
            if self.prefix_cache is not None:
                self.prefix_cache.admitted_tokens += req.seq_len
                self.prefix_cache.hit_tokens += req.num_cached
            budget -= self._plan_chunk(req, budget, grants, extends)

        released, self._released = self._released, []
        if not extends and not decode_slots:
            if released:  # nothing to run, but the worker should still forget these slots
                self._released = released
            return None
        self.step_id += 1
        self._inflight[self.step_id] = self._planning
        return StepPlan(step_id=self.step_id, new_requests=new_requests, grants=grants,
                        extends=extends, decode_slots=pack_i32(decode_slots),
                        released_slots=pack_i32(released))

    def _decoding_requests(self) -> list[Request]:
        return [r for r in self.running.values() if r.state == RequestState.DECODING]

    def _mark_sampling(self, req: Request) -> None:
        self._planning[req.slot] = (req, req.num_preemptions)
        req.num_inflight += 1

    def _will_finish_by_length(self, req: Request) -> bool:
        produced = len(req.output_ids) + req.num_inflight
        return (produced >= req.params.max_new_tokens
                or len(req.prompt_ids) + produced >= self.max_seq_len)

    def _plan_chunk(self, req: Request, budget: int, grants: list[PageGrant],
                    extends: list[ExtendEntry]) -> int:
        ids = req.all_ids  # after a retraction the outputs so far are recomputed too
        # Prefill never retracts others: it takes what the free pages allow, maybe nothing.
        room = (len(req.pages) + self._num_free_pages()) * self.pages.page_size - req.num_cached
        chunk = min(budget, len(ids) - req.num_cached, room)
        if chunk <= 0:
            return 0
        end = req.num_cached + chunk
        self._grow(req, end, grants)
        done = end == len(ids)
        extends.append(ExtendEntry(req.slot, req.num_cached, pack_i32(ids[req.num_cached:end]),
                                   done, -1 if done else ids[end]))
        if done:
            self._mark_sampling(req)
            req.state = RequestState.DECODING  # the next plan may decode it before this result
        req.num_cached = end
        return chunk

    def _grow(self, req: Request, num_tokens: int, grants: list[PageGrant]) -> bool:
        """Make req own pages for num_tokens tokens, retracting newer requests if needed.
        Returns False if req itself had to be retracted."""
        need = self.pages.pages_for(num_tokens) - len(req.pages)
        if need <= 0:  # most decode steps: the last page has room
            return True
        while need > self._num_free_pages():
            victim = next(reversed(self.running.values()))
            self._retract(victim, grants)
            if victim is req:
                return False
        new_pages = self._allocate_pages(need)
        grants.append(PageGrant(req.slot, len(req.pages), pack_i32(new_pages)))
        req.pages.extend(new_pages)
        return True

    def _borrow_prefix(self, req: Request) -> list:
        """The cached blocks its tokens start with, borrowed (so not evictable), leaving at
        least its last token to compute."""
        if self.prefix_cache is None:
            return []
        ids = req.all_ids
        blocks = self.prefix_cache.match(ids, len(ids) - 1)
        self.prefix_cache.borrow(blocks)
        return blocks

    def _num_free_pages(self) -> int:
        """Free pages, counting the cached pages nobody borrows (taken back on demand)."""
        cached = 0 if self.prefix_cache is None else self.prefix_cache.num_evictable
        return self.pages.num_free + cached

    def _allocate_pages(self, n: int) -> list[int]:
        short = n - self.pages.num_free
        if short > 0 and self.prefix_cache is not None:
            self.pages.free(self.prefix_cache.evict(short))
        return self.pages.allocate(n)

    def _retract(self, req: Request, grants: list[PageGrant]) -> None:
        grants[:] = [g for g in grants if g.slot != req.slot]
        if self._planning.pop(req.slot, None) is not None:
            req.num_inflight -= 1
        self._release_resources(req)
        req.state = RequestState.WAITING
        req.num_cached = 0
        req.num_preemptions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _release_resources(self, req: Request) -> None:
        if req.slot is not None:
            del self.running[req.slot]
            self.slots.free(req.slot)
            self._released.append(req.slot)
            req.slot = None
        if self.prefix_cache is None:
            self.pages.free(req.pages)
        else:  # KV exists for the tokens planned so far (a plan in flight runs before any
            # later one that could borrow them), known here up to seq_len
            self.pages.free(self.prefix_cache.release(
                req.all_ids, req.pages, min(req.num_cached, req.seq_len), req.borrowed))
        req.pages = []
        req.borrowed = []

    # -- results in, outputs out ------------------------------------------------------------

    def process_result(self, result: StepResult) -> list[TokenOutput]:
        slots = unpack_i32(result.slots)
        tokens = unpack_i32(result.token_ids)
        # Under speculation a verify row emits accept_len + 1 tokens, a prefill row one.
        accept = unpack_i32(result.accept_lens) if result.accept_lens else None
        counts = np.ones(len(slots), dtype=np.int64) if accept is None else np.maximum(accept + 1, 1)
        starts = (np.cumsum(counts) - counts).tolist()
        counts, tokens = counts.tolist(), tokens.tolist()  # Python ints: read row by row
        planned = self._inflight.pop(result.step_id, {})
        outputs = []
        accepted: list[int] = []  # this step's verify rows, for the service-wide statistics
        now = time.monotonic()
        for row, slot in enumerate(slots.tolist()):
            entry = planned.get(slot)
            if entry is None:
                continue
            req, epoch = entry
            req.num_inflight -= 1
            if req.state == RequestState.FINISHED or req.slot != slot or \
                    req.num_preemptions != epoch:
                self.num_stale_results += 1
                continue  # finished, aborted or retracted after this step was planned: drop
            first = starts[row]
            out, reason = TokenOutput(req.rid, [], first), None
            for token in tokens[first:first + counts[row]]:
                out.token_ids.append(token)
                reason = self._on_token(req, token, now)
                if reason is not None:  # tokens past a stop are dropped
                    break
            if accept is not None and accept[row] >= 0:  # a verify row: acceptance counts
                # only what is emitted, not drafts dropped past a stop or max_new_tokens
                req.record_accept(len(out.token_ids) - 1)
                accepted.append(len(out.token_ids) - 1)
            if reason is not None:
                out = self._finish(req, reason, token_ids=out.token_ids, result_row=first)
            out.completion_tokens = len(req.output_ids)
            outputs.append(out)
        self.spec_stats.record_step(accepted)
        return outputs

    def _on_token(self, req: Request, token: int, now: float) -> FinishReason | None:
        if req.first_token_time is None:
            req.first_token_time = now
        req.state = RequestState.DECODING
        req.output_ids.append(token)
        params = req.params
        n_out = len(req.output_ids)
        if n_out >= params.min_new_tokens and (
                (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids):
            return FinishReason.STOP
        if n_out >= params.max_new_tokens or req.seq_len >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def end_at_stop_string(self, out: TokenOutput, keep: int) -> TokenOutput:
        """The text of out.token_ids[keep - 1] completed a stop string: the request ends there
        with "stop", as if out's later tokens (the rest of a verify row) never came. Returns
        what replaces out."""
        dropped, accepted = len(out.token_ids) - keep, len(out.token_ids) - 1
        if dropped:  # a verify row (others emit one token), its drafts counted as emitted:
            # count only those kept, in this step's statistics too
            self.spec_stats.drop_accepted(accepted, dropped)
        req = self.requests.get(out.rid)
        if req is not None:  # still running: end it now, freeing its slot and pages
            del req.output_ids[len(req.output_ids) - dropped:]
            req.drop_accepted(dropped)
            end = self._finish(req, FinishReason.STOP, token_ids=out.token_ids[:keep],
                               result_row=out.result_row)
        else:  # ended on a later token of the row (eos, length): its resources are free
            # already (whatever the dropped tokens were, KV was planned only before them)
            end = out
            end.token_ids, end.finish_reason = out.token_ids[:keep], FinishReason.STOP
            end.completion_tokens -= dropped
            end.spec_accepted_drafts -= dropped
            count_accepted(end.spec_accepted_per_position, accepted, -1, keep - 1)
        return end

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None,
                token_ids: list[int] | None = None, result_row: int = 0) -> TokenOutput:
        self._release_resources(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.rid, None)
        per_position = list(req.spec_accepted_per_position)
        if req.spec_verify_steps:  # one entry per draft position, depths never accepted too
            per_position += [0] * (self.info.spec_num_steps - len(per_position))
        return TokenOutput(req.rid, token_ids or [], result_row, reason, len(req.prompt_ids),
                           len(req.output_ids), error, req.spec_verify_steps,
                           req.spec_accepted_drafts, per_position)

    # -- introspection ----------------------------------------------------------------------

    def accounting(self) -> dict[str, int]:
        return {"free_pages": self._num_free_pages(), "total_pages": self.pages.capacity,
                "cached_pages": 0 if self.prefix_cache is None else self.prefix_cache.num_blocks,
                "prefix_cache_hit_tokens": 0 if self.prefix_cache is None
                else self.prefix_cache.hit_tokens,
                "free_slots": self.slots.num_free, "total_slots": self.slots.capacity,
                "waiting": len(self.waiting), "running": len(self.running)}

