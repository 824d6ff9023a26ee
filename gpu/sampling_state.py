"""Per-slot sampling parameters and token counts on the device (one row per request slot),
with host mirrors that let a batch pick its sampling path without touching the device, and the
penalties and min_new_tokens ban computed from them. The sampler (gpu/sampler.py) reads them.
"""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu.device import host_to_device
from ipc.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------
# Per-slot state.

# Columns of SamplingState.float_params / int_params.
F_TEMP, F_TOP_P, F_LOG_MIN_P, F_REP, F_FREQ, F_PRES = range(6)
I_TOP_K, I_SEED, I_GREEDY, I_MIN_NEW = range(4)
# A free slot (and padding slot 0): greedy, no filters, no penalties.
_FREE_FLOATS = (1.0, math.inf, -math.inf, 1.0, 0.0, 0.0)
_FREE_INTS = (0, 0, 1, 0)


@dataclass(frozen=True)
class BatchFlags:
    """What a batch needs, from the host mirrors; chooses the fast paths."""

    all_greedy: bool
    any_greedy: bool
    any_penalty: bool  # over all rows: penalties apply to greedy rows too
    any_min_tokens: bool  # some row must not stop yet (eos / stop ids banned)
    any_top_k: bool  # the rest are over sampled (non-greedy) rows only
    all_top_k: bool
    max_top_k: int
    all_truncated: bool  # every sampled row has top_k or top_p: a short candidate list may do
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int  # -1: no row wants logprobs

    @property
    def argmax_only(self) -> bool:
        """Every row takes the logits' argmax and nothing else: greedy, no penalties, no
        min-token bans, no logprobs (the caller may then skip the logits,
        LlamaModel.lm_head_tokens)."""
        return (self.all_greedy and not (self.any_penalty or self.any_min_tokens)
                and self.max_logprobs < 0)

    @property
    def noise_only(self) -> bool:
        """Every row takes argmax(logit / T + noise) (greedy rows: the argmax) and nothing
        else: no top-k, top-p or min-p cut, no penalties, bans or logprobs (gpu/cpu_sampling.py
        then draws in one pass)."""
        return not (self.any_top_k or self.any_top_p or self.any_min_p or self.any_penalty
                    or self.any_min_tokens or self.max_logprobs >= 0)


@dataclass(frozen=True)
class DraftedBefore:
    """Per logits row, the tokens that come before the one it samples but are not in its
    slot's counts yet: a verify-tree node samples the token after the drafts on its path, and
    plain decoding would have counted those (penalties, min_new_tokens) by then.
    tokens [rows, D] int64; weights [rows, D] 0/1: which of them are on the row's path."""

    tokens: torch.Tensor
    weights: torch.Tensor

    def rows(self, index: torch.Tensor) -> "DraftedBefore":
        return DraftedBefore(self.tokens[index], self.weights[index])


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None = None  # [bs] float32, the sampled token's
    # [bs, n] with n the largest request in the batch; rows asking fewer ignore the extra columns.
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


_NO_OUTPUTS = np.iinfo(np.int64).max  # a slot whose prefill is all prompt


class SamplingState:
    """Per-slot sampling parameters and token counts on the device (row = request slot)."""

    @torch.inference_mode(False)  # normal tensors, updatable in and out of inference mode
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str,
                 eos_token_ids: Sequence[int] = (), unseeded: random.Random | None = None):
        """`unseeded`: where a request without a seed gets one (default: the OS's entropy);
        tensor-parallel ranks share one seeded generator, so they draw the same seeds."""
        self.num_slots = num_slots
        self._unseeded = unseeded
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # min_new_tokens bans these (unless ignore_eos) together with the request's stop ids.
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        dev = self.device
        self.float_params = torch.tensor([_FREE_FLOATS] * num_slots, dtype=torch.float32,
                                         device=dev)
        self.int_params = torch.tensor([_FREE_INTS] * num_slots, dtype=torch.int64, device=dev)
        self.generated_len = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        # [num_slots, vocab] tables, allocated with the first request that needs them.
        self.prompt_seen: torch.Tensor | None = None  # bool: repetition penalty's prompt part
        self.output_counts: torch.Tensor | None = None  # int32: generated-token counts
        self.min_tokens_ban: torch.Tensor | None = None  # bool: ids banned before min_new_tokens
        # Host mirrors for BatchFlags.
        self._greedy = np.ones(num_slots, dtype=bool)
        self._penalised = np.zeros(num_slots, dtype=bool)
        self._min_tokens = np.zeros(num_slots, dtype=bool)
        self._top_k = np.zeros(num_slots, dtype=np.int64)
        self._top_p = np.zeros(num_slots, dtype=bool)
        self._min_p = np.zeros(num_slots, dtype=bool)
        self._logprobs = np.full(num_slots, -1, dtype=np.int64)
        self.seeds = np.zeros(num_slots, dtype=np.int64)  # the seed each slot draws with
        # Where each slot's outputs start among its prefill positions (add_prefill_chunk).
        self._output_start = np.full(num_slots, _NO_OUTPUTS, dtype=np.int64)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return host_to_device(t, self.device)

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"request slot {slot} is out of range: slots are "
                             f"1..{self.num_slots - 1} (slot 0 is padding)")

    @torch.inference_mode(False)  # also when first needed inside the worker's inference mode
    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.num_slots, self.vocab_size, dtype=dtype, device=self.device)

    def set_request(self, slot: int, params: SamplingParams,
                    prompt_ids: torch.Tensor | Sequence[int] = (), output_start: int = -1
                    ) -> None:
        """A request enters `slot`: store its parameters and reset its counts. `output_start`
        (-1: none): the position of its first output, for a request whose prefill recomputes
        outputs it generated before a retraction (add_prefill_chunk)."""
        self._check_slot(slot)
        params.validate(self.vocab_size)
        seed = params.seed if params.seed is not None else (
            secrets.randbits(63) if self._unseeded is None else self._unseeded.getrandbits(63))
        greedy = params.greedy
        # Greedy rows take the argmax; their filters are dropped so they never cost a filter pass.
        top_k = params.top_k if 0 < params.top_k < self.vocab_size and not greedy else 0
        top_p = params.top_p if params.top_p < 1.0 and not greedy else 1.0
        min_p = params.min_p if not greedy else 0.0
        self.float_params[slot] = self._to_device(torch.tensor([
            1.0 if greedy else params.temperature,
            top_p if top_p < 1.0 else math.inf,  # inf: float rounding can never cut the tail
            math.log(min_p) if min_p > 0.0 else -math.inf,
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
        ], dtype=torch.float32))
        self.int_params[slot] = self._to_device(
            torch.tensor([top_k, seed, int(greedy), params.min_new_tokens]))
        # In-place fills on views: `t[slot] = 0` copies a CPU scalar in, which syncs on CUDA.
        self.generated_len[slot].zero_()

        penalised = params.has_penalties
        if penalised and self.prompt_seen is None:
            self.prompt_seen = self._table(torch.bool)
            self.output_counts = self._table(torch.int32)
        if self.prompt_seen is not None:
            self.prompt_seen[slot].fill_(False)
            self.output_counts[slot].zero_()

        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        min_tokens = params.min_new_tokens > 0 and bool(banned)
        if min_tokens:
            if self.min_tokens_ban is None:
                self.min_tokens_ban = self._table(torch.bool)
            self.min_tokens_ban[slot].fill_(False)
            self.min_tokens_ban[slot].index_fill_(0, self._to_device(torch.tensor(banned)), True)

        self._greedy[slot] = greedy
        self._penalised[slot] = penalised
        self._min_tokens[slot] = min_tokens
        self._top_k[slot] = top_k
        self._top_p[slot] = top_p < 1.0
        self._min_p[slot] = min_p > 0.0
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.seeds[slot] = seed
        self._output_start[slot] = output_start if output_start >= 0 else _NO_OUTPUTS
        self.add_prompt_tokens(slot, prompt_ids)

    def add_prefill_chunk(self, slot: int, ids: np.ndarray, start: int) -> None:
        """A prefill chunk at positions start, start + 1, ...: prompt tokens for the repetition
        penalty, and from the slot's output_start on, outputs the request generated before a
        retraction: counted as generated again (frequency / presence penalties,
        min_new_tokens), or it would repeat and stop differently than it would have."""
        split = int(min(len(ids), max(0, self._output_start[slot] - start)))
        self.add_prompt_tokens(slot, torch.from_numpy(ids[:split].astype(np.int64)))
        if split < len(ids):
            outputs = ids[split:].astype(np.int64)
            self.record_outputs(self._to_device(np.full(len(outputs), slot, dtype=np.int64)),
                                self._to_device(outputs))

    def add_prompt_tokens(self, slot: int, ids: torch.Tensor | Sequence[int]) -> None:
        """More of the prompt was seen (a prefill chunk): the repetition penalty covers it."""
        if not self._penalised[slot] or len(ids) == 0:
            return
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        self.prompt_seen[slot].index_fill_(0, ids, True)

    def record_outputs(self, slots: torch.Tensor, token_ids: torch.Tensor,
                       weights: torch.Tensor | None = None) -> None:
        """Count generated tokens (one per row; a slot may repeat, e.g. accepted drafts).
        `weights` (bool or 0/1 per row) counts only some rows at a static shape: a boolean
        mask index would make the host wait for the device."""
        if slots.numel() == 0:
            return
        slots, token_ids = slots.long(), token_ids.long()
        counts = torch.ones_like(slots) if weights is None else weights.long()
        self.generated_len.index_add_(0, slots, counts)
        if self.output_counts is not None:
            self.output_counts.index_put_((slots, token_ids), counts.to(torch.int32),
                                          accumulate=True)

    def seeds_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The seed each of `slots` draws with, on the device (no host sync)."""
        return self.int_params[slots, I_SEED]

    def release(self, slot: int) -> None:
        """The slot is free: back to greedy with no extras, so stale rows cost nothing."""
        self._check_slot(slot)
        self.float_params[slot] = self._to_device(torch.tensor(_FREE_FLOATS, dtype=torch.float32))
        self.int_params[slot] = self._to_device(torch.tensor(_FREE_INTS))
        for mirror, free in ((self._greedy, True), (self._penalised, False),
                             (self._min_tokens, False), (self._top_k, 0), (self._top_p, False),
                             (self._min_p, False), (self._logprobs, -1)):
            mirror[slot] = free

    def max_logprobs(self, slots: np.ndarray) -> int:
        """The most logprobs any of these slots asks for; -1 when none asks (host only)."""
        return int(self._logprobs[slots].max()) if len(slots) else -1

    def batch_flags(self, slots: np.ndarray) -> BatchFlags:
        greedy = self._greedy[slots]
        sampled = ~greedy
        top_k = self._top_k[slots][sampled]
        n_sampled = int(sampled.sum())
        n_top_k = int((top_k > 0).sum())
        top_p = self._top_p[slots][sampled]
        return BatchFlags(
            all_greedy=n_sampled == 0,
            any_greedy=n_sampled < len(slots),
            any_penalty=bool(self._penalised[slots].any()),
            any_min_tokens=bool(self._min_tokens[slots].any()),
            any_top_k=n_top_k > 0,
            all_top_k=n_sampled > 0 and n_top_k == n_sampled,
            max_top_k=int(top_k.max()) if n_top_k else 0,
            all_truncated=n_sampled > 0 and bool(((top_k > 0) | top_p).all()),
            any_top_p=bool(top_p.any()),
            any_min_p=bool(self._min_p[slots][sampled].any()),
            max_logprobs=int(self._logprobs[slots].max()) if len(slots) else -1,
        )


# ---------------------------------------------------------------------------------------------
# The sampler.


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState,
                    drafted: DraftedBefore | None = None) -> torch.Tensor:
    """Repetition (prompt + output, HF: divide positive / multiply negative logits), then
    frequency and presence (output only, OpenAI). Rows without penalties come out unchanged.
    `drafted`: outputs before each row's token that the slot's counts lack yet."""
    assert state.output_counts is not None, "no request with penalties was ever admitted"
    fp = state.float_params[slots]
    counts = state.output_counts[slots]
    if drafted is not None and drafted.tokens.numel():
        counts = counts.scatter_add(1, drafted.tokens.long(),
                                    drafted.weights.to(counts.dtype))
    generated = counts > 0
    seen = state.prompt_seen[slots] | generated
    rep = fp[:, F_REP, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - fp[:, F_FREQ, None] * counts - fp[:, F_PRES, None] * generated


def apply_min_tokens(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState,
                     drafted: DraftedBefore | None = None) -> torch.Tensor:
    """Ban eos / stop ids for rows that have generated fewer than min_new_tokens (counting
    `drafted`, the outputs before each row's token that the slot's count lacks yet)."""
    assert state.min_tokens_ban is not None
    generated = state.generated_len[slots]
    if drafted is not None:
        generated = generated + drafted.weights.long().sum(-1)
    too_early = generated < state.int_params[slots, I_MIN_NEW]
    return logits.masked_fill(state.min_tokens_ban[slots] & too_early[:, None], -math.inf)
