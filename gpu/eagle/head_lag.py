"""The draft head left behind while the gate keeps a batch from drafting, and caught up later.

A plain decode step of the EAGLE step used to run the head over its one new token too, so
that a later drafting step found the head's KV and relayed top-k complete. On a 2-core CPU
that follow-along cost ~1.5-2 ms a token (the head's ~25 small ops), as much as drafting saves
there, so "auto" could not make speculation cost nothing where it does not pay (issue 29 item
6). Now, where the gate is timed (a CPU worker), a plain step only records what the head
would have read: the token and the target's captured states, per request. Before a request
drafts again, or once it is MAX_LAG tokens behind, the head runs once over all of them as an
extend (the same positions, KV locations and pairing as the steps it skipped) and stashes
the top-k of the last, as the last of those steps would have. A new prefill of a slot forgets
what its previous request left behind.

A request admitted while the gate finds drafting slower than plain at the batch's size
(SpecGate.admits_headless: 8 streams on a 2-core CPU) is *headless*: the head never runs
over its prompt or its tokens and it never drafts; a step with such a request decodes plain.
The head's prefill over every prompt and the states plain steps keep cost ~5% there, for
drafts that would never come. A request admitted with the head (alone, at the start of a
burst) whose batch grows to such a size goes on headless too (`drop_heads`): else every step
of its batch captures states for it.

On one GPU, "auto" is a fixed limit (gpu/eagle/spec_gate.py) and nothing is deferred (a
deferral reads positions on the host): requests admitted into a batch above the limit run
headless, those admitted with the head drop it once their batch grows past it, and a request
joining a headless one is headless too, so a step holds headed requests only where it drafts.
Its steps above the limit are then the plain step's, CUDA graphs included: where the head
followed along, EAGLE-3 served 8 streams at 0.72-0.96x the plain service (H100, H200).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu.device import host_to_device
from gpu.forward_batch import ForwardMode
from gpu.sync_guard import expected_sync
from ipc.worker_messages import unpack_i32

# Tokens a request's head may fall behind before it catches up anyway: bounds the states kept
# (a token's EAGLE-3 features are 3 x hidden floats) and the catch-up's extend.
MAX_LAG = 64


def head_regime(state, limit: int | str) -> str:
    """How an EAGLE step's plain steps treat the draft head, for spec.disable_above_batch_size
    `limit`: "timed" (a CPU worker: the gate times both ways, plain steps defer the head),
    "drop" ("auto" on one GPU: above its limit requests run headless, as the plain step) or
    "follow" (the head runs over every plain step: a fixed limit on a GPU, so a shrinking batch
    drafts again; deterministic mode and TP or DP-attention ranks, which must all make the
    same forwards)."""
    if state.cfg.runtime.deterministic or state.dp_attention is not None or \
            state.shard is not None:
        return "follow"
    if state.device.type == "cpu":
        return "timed"
    return "drop" if limit == "auto" else "follow"


@dataclass
class _Behind:
    first_position: int  # the first skipped token's position (its KV index in the request)
    tokens: list[torch.Tensor] = field(default_factory=list)  # [1] each: the head's input id
    states: list[torch.Tensor] = field(default_factory=list)  # [1, width] each

    @property
    def next_position(self) -> int:
        return self.first_position + len(self.tokens)


class HeadLag:
    def __init__(self, step) -> None:
        self.step = step  # the EagleStep: its drafter, batches and FutureMap
        self.behind: dict[int, _Behind] = {}
        self.headless: set[int] = set()  # slots whose requests run without the head
        self.running: set[int] = set()  # slots holding a request (admitted, not released)
        # Host seconds and tokens of every catch-up so far: the gate charges them to the
        # plain way, whose deferred cost they are, not to the step they happen in.
        self.seconds = 0.0
        self.tokens = 0

    def take_plan(self, plan, gate) -> None:
        """A plan's requests released and admitted, headless where the SpecGate `gate` says
        so by the size of the batch: every request the worker holds (many still to prefill)."""
        self.release(unpack_i32(plan.released_slots))
        new = [r.slot for r in plan.new_requests]
        headed = bool(new) or bool(self.running - self.headless)
        if headed and gate.admits_headless(len(self.running | set(new))):
            self.admit(new, headless=True)
            self.drop_heads()  # those admitted with the head before their batch grew
        elif new:  # beside a headless request a head would only follow (never defer on a GPU)
            self.admit(new, headless=gate.drops_heads and bool(self.headless))

    def admit(self, slots_host, headless: bool) -> None:
        """New requests in these slots: their last ones' lag is moot."""
        for slot in np.asarray(slots_host).tolist():
            self.behind.pop(int(slot), None)
            (self.headless.add if headless else self.headless.discard)(int(slot))
            self.running.add(int(slot))

    def drop_heads(self) -> None:
        """Every running request goes on headless: one admitted with the head, whose batch has
        grown past break-even since, stops paying for it (captured states on every step)."""
        for slot in self.running - self.headless:
            self.behind.pop(slot, None)
        self.headless |= self.running

    def release(self, slots_host) -> None:
        for slot in np.asarray(slots_host).tolist():
            self.behind.pop(int(slot), None)
            self.headless.discard(int(slot))
            self.running.discard(int(slot))

    def all_headless(self, slots_host) -> bool:
        return all(int(s) in self.headless for s in np.asarray(slots_host).tolist())

    def any_headless(self, slots_host) -> bool:
        return any(int(s) in self.headless for s in np.asarray(slots_host).tolist())

    def defer(self, slots_host: np.ndarray, positions: torch.Tensor, tokens: torch.Tensor,
              states: torch.Tensor) -> None:
        """Record one plain step's head inputs: request i's token tokens[i] at position
        positions[i] (host-readable: a CPU worker), paired with its states[i]. Headless
        requests' rows are dropped."""
        if self.headless:
            keep = [i for i, s in enumerate(slots_host.tolist()) if s not in self.headless]
            if not keep:
                return
            if len(keep) < len(slots_host):
                rows = torch.tensor(keep, device=tokens.device)
                slots_host, positions = slots_host[keep], positions[rows]
                tokens, states = tokens[rows], states[rows]
        # Only where the gate is timed (a CPU worker, no device); where it drops heads (a GPU)
        # no step defers, and the guard (gpu/sync_guard.py) would catch this read.
        with nullcontext() if self.step.gate.drops_heads else expected_sync():
            positions = positions.tolist()
        stale = [s for s, p in zip(slots_host.tolist(), positions)
                 if s in self.behind and self.behind[s].next_position != p]
        if stale:  # not the next token (should not happen): bring those up to date first
            self.catch_up(np.array(stale, dtype=np.int64))
        for i, (slot, position) in enumerate(zip(slots_host.tolist(), positions)):
            behind = self.behind.setdefault(slot, _Behind(position))
            behind.tokens.append(tokens[i:i + 1])
            behind.states.append(states[i:i + 1])
        if max(len(self.behind[s].tokens) for s in slots_host.tolist()) >= MAX_LAG:
            self.catch_up(slots_host)

    def catch_up(self, slots_host: np.ndarray) -> None:
        """Run the head over every token these requests skipped, as one extend; stash the
        top-k and state of each one's last token (the next drafting step reads them)."""
        slots = [s for s in slots_host.tolist() if s in self.behind]
        if not slots:
            return
        start, step = time.perf_counter(), self.step
        behind = [self.behind.pop(s) for s in slots]
        dev = step.state.device
        lens_host = np.array([len(b.tokens) for b in behind], dtype=np.int64)
        firsts_host = np.array([b.first_position for b in behind], dtype=np.int64)
        lens, firsts = host_to_device(lens_host, dev), host_to_device(firsts_host, dev)
        slot_t = host_to_device(np.array(slots, dtype=np.int64), dev)
        # Each skipped token's KV index in its request, and its request's slot, per row.
        index = host_to_device(np.concatenate([np.arange(b.first_position, b.next_position)
                                               for b in behind]), dev)
        row_slots = host_to_device(np.repeat(np.array(slots, dtype=np.int64), lens_host), dev)
        locs = step.state.req_to_token.req_to_token[row_slots, index].long()
        tokens = torch.cat([t for b in behind for t in b.tokens])
        states = torch.cat([x for b in behind for x in b.states])
        batch = step.batches.make(ForwardMode.EXTEND, tokens, index.clamp(max=step.max_position),
                                  slot_t, firsts, lens, firsts + lens, locs)
        h_out, h_logits = step.drafter.forward(batch, states)
        last = torch.cumsum(lens, 0) - 1
        top_p, top_ids = step.drafter.topk(h_logits[last])
        step.state.future_map.stash_spec(slot_t, top_p, top_ids, h_out[last])
        self.seconds += time.perf_counter() - start
        self.tokens += int(lens_host.sum())
