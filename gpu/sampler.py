"""Batched sampling with per-request parameters, indexed by request slot.

Every parameter lives in a device table with one row per request slot, written once when the
request is admitted (`SamplingState.set_request`), so a step's only input besides the logits is
the batch's slots. Host mirrors of the same parameters pick the fast path for a batch without
touching the device:

- every row greedy, no penalties   -> one argmax (the common case)
- no row has penalties             -> the penalty gathers are skipped
- every sampled row has top_k > 0  -> ``torch.topk(max_k)`` instead of a full-vocabulary sort
- some top_p without universal top_k -> full sort
- temperature / min_p only         -> no sort at all

Randomness: no shared ``torch.Generator``. A draw hashes ``(seed, position, token id)`` with
splitmix64 in int64 tensor ops into a uniform ``u`` and samples by Gumbel-max,
``argmax(logit / T - log(-log u))`` over the allowed tokens. A token's noise depends only on its
own request's seed, the position being sampled and the token id, so a seeded request draws the
same tokens alone or in any batch, in any order, whichever path the batch takes (up to
floating-point ties at a filter boundary).

Logprobs are those of the distribution the sampler draws from before truncation:
``log_softmax(penalised_logits / T)``, ahead of top-k / top-p / min-p, so the top-n alternatives
stay finite. Greedy rows (temperature 0 or top_k 1) report them at T = 1. (vLLM's default is the
raw model distribution; with no penalties and T = 1 the two agree.)
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ipc.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------
# Counter-based random numbers: splitmix64 on int64 tensors (multiplication wraps mod 2**64).


def _as_i64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _as_i64(0x9E3779B97F4A7C15)
_MIX1 = _as_i64(0xBF58476D1CE4E5B9)
_MIX2 = _as_i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift: torch's ``>>`` on int64 is arithmetic, so mask the sign copies off."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shr(z, 31))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One 64-bit key per draw (seed, position). `stream` separates independent uses of the same
    draw (token sampling is stream 0; e.g. speculative acceptance can use stream 1)."""
    z = seeds.long() + _as_i64((stream + 1) * 0x9E3779B97F4A7C15)
    _mix64_(z)
    z += (positions.long() + 1) * _GOLDEN
    return _mix64_(z)


def _token_terms(token_ids: torch.Tensor) -> torch.Tensor:
    return (token_ids.long() + 1) * _GOLDEN


def _uniform_from_terms(keys: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """Uniforms in [2**-24, 1 - 2**-24], so -log(-log u) is always finite."""
    z = _mix64_(terms + keys[:, None])
    u = _shr(z, 41).float()  # the top 23 bits: exact in float32
    return u.add_(0.5).mul_(2.0**-23)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                   stream: int = 0) -> torch.Tensor:
    """Uniform(0, 1) per (row, column): a pure function of (seed, position, token id, stream).
    seeds, positions: [bs]; token_ids: [bs, n] or [n]. Returns float32 [bs, n]."""
    return _uniform_from_terms(row_keys(seeds, positions, stream), _token_terms(token_ids))


def _gumbel_(u: torch.Tensor) -> torch.Tensor:
    return u.log_().neg_().log_().neg_()


# ---------------------------------------------------------------------------------------------
# Per-slot state.

# Columns of SamplingState.float_params / int_params.
_F_TEMP, _F_TOP_P, _F_LOG_MIN_P, _F_REP, _F_FREQ, _F_PRES = range(6)
_I_TOP_K, _I_SEED, _I_GREEDY, _I_MIN_NEW = range(4)
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
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int  # -1: no row wants logprobs


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None = None  # [bs] float32, the sampled token's
    # [bs, n] with n the largest request in the batch; rows asking fewer ignore the extra columns.
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class SamplingState:
    """Per-slot sampling parameters and token counts on the device (row = request slot)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str,
                 eos_token_ids: Sequence[int] = ()):
        self.num_slots = num_slots
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

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"request slot {slot} is out of range: slots are 1..{self.num_slots - 1}"
                             " (slot 0 is padding)")

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.num_slots, self.vocab_size, dtype=dtype, device=self.device)

    def set_request(self, slot: int, params: SamplingParams,
                    prompt_ids: torch.Tensor | Sequence[int] = ()) -> None:
        """A request enters `slot`: store its parameters and reset its counts."""
        self._check_slot(slot)
        params.validate(self.vocab_size)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        greedy = params.greedy
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self.float_params[slot] = torch.tensor([
            1.0 if greedy else params.temperature,
            params.top_p if params.top_p < 1.0 else math.inf,  # inf: rounding never cuts the tail
            math.log(params.min_p) if params.min_p > 0.0 else -math.inf,
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
        ], dtype=torch.float32)
        self.int_params[slot] = torch.tensor([top_k, seed, int(greedy), params.min_new_tokens])
        self.generated_len[slot] = 0

        penalised = params.has_penalties
        if penalised and self.prompt_seen is None:
            self.prompt_seen = self._table(torch.bool)
            self.output_counts = self._table(torch.int32)
        if self.prompt_seen is not None:
            self.prompt_seen[slot] = False
            self.output_counts[slot] = 0

        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        min_tokens = params.min_new_tokens > 0 and bool(banned)
        if min_tokens:
            if self.min_tokens_ban is None:
                self.min_tokens_ban = self._table(torch.bool)
            self.min_tokens_ban[slot] = False
            self.min_tokens_ban[slot, torch.tensor(banned, device=self.device)] = True

        self._greedy[slot] = greedy
        self._penalised[slot] = penalised
        self._min_tokens[slot] = min_tokens
        self._top_k[slot] = top_k
        self._top_p[slot] = params.top_p < 1.0
        self._min_p[slot] = params.min_p > 0.0
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.seeds[slot] = seed
        self.add_prompt_tokens(slot, prompt_ids)

    def add_prompt_tokens(self, slot: int, ids: torch.Tensor | Sequence[int]) -> None:
        """More of the prompt was seen (a prefill chunk): the repetition penalty covers it."""
        if not self._penalised[slot] or len(ids) == 0:
            return
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        self.prompt_seen[slot, ids] = True

    def record_outputs(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count generated tokens (one per row; a slot may repeat, e.g. accepted drafts)."""
        if slots.numel() == 0:
            return
        slots, token_ids = slots.long(), token_ids.long()
        self.generated_len.index_add_(0, slots, torch.ones_like(slots))
        if self.output_counts is not None:
            ones = torch.ones(slots.shape, dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((slots, token_ids), ones, accumulate=True)

    def release(self, slot: int) -> None:
        """The slot is free: back to greedy with no extras, so stale rows cost nothing."""
        self._check_slot(slot)
        self.float_params[slot] = torch.tensor(_FREE_FLOATS, dtype=torch.float32)
        self.int_params[slot] = torch.tensor(_FREE_INTS)
        for mirror, free in ((self._greedy, True), (self._penalised, False),
                             (self._min_tokens, False), (self._top_k, 0), (self._top_p, False),
                             (self._min_p, False), (self._logprobs, -1)):
            mirror[slot] = free

    def batch_flags(self, slots: np.ndarray) -> BatchFlags:
        greedy = self._greedy[slots]
        sampled = ~greedy
        top_k = self._top_k[slots][sampled]
        n_sampled = int(sampled.sum())
        n_top_k = int((top_k > 0).sum())
        return BatchFlags(
            all_greedy=n_sampled == 0,
            any_greedy=n_sampled < len(slots),
            any_penalty=bool(self._penalised[slots].any()),
            any_min_tokens=bool(self._min_tokens[slots].any()),
            any_top_k=n_top_k > 0,
            all_top_k=n_sampled > 0 and n_top_k == n_sampled,
            max_top_k=int(top_k.max()) if n_top_k else 0,
            any_top_p=bool(self._top_p[slots][sampled].any()),
            any_min_p=bool(self._min_p[slots][sampled].any()),
            max_logprobs=int(self._logprobs[slots].max()) if len(slots) else -1,
        )


# ---------------------------------------------------------------------------------------------
# The sampler.


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Repetition (prompt + output, HF: divide positive / multiply negative logits), then
    frequency and presence (output only, OpenAI). Rows without penalties come out unchanged."""
    assert state.output_counts is not None, "no request with penalties was ever admitted"
    fp = state.float_params[slots]
    counts = state.output_counts[slots]
    generated = counts > 0
    seen = state.prompt_seen[slots] | generated
    rep = fp[:, _F_REP, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - fp[:, _F_FREQ, None] * counts - fp[:, _F_PRES, None] * generated


def apply_min_tokens(logits: torch.Tensor, slots: torch.Tensor,
                     state: SamplingState) -> torch.Tensor:
    """Ban eos / stop ids for rows that have generated fewer than min_new_tokens."""
    assert state.min_tokens_ban is not None
    too_early = state.generated_len[slots] < state.int_params[slots, _I_MIN_NEW]
    return logits.masked_fill(state.min_tokens_ban[slots] & too_early[:, None], -math.inf)


class Sampler:
    def __init__(self, state: SamplingState):
        self.state = state
        self._vocab_terms: torch.Tensor | None = None  # _token_terms(arange(vocab)), cached
        self._arange: torch.Tensor | None = None

    def batch_flags(self, slots: torch.Tensor, slots_host=None) -> BatchFlags:
        if slots_host is not None:
            host = np.asarray(slots_host, dtype=np.int64)
        else:  # on a GPU this syncs: the worker should pass the plan's slots as slots_host
            host = slots.cpu().numpy().astype(np.int64, copy=False)
        return self.state.batch_flags(host)

    def process_logits(self, logits: torch.Tensor, slots: torch.Tensor,
                       flags: BatchFlags) -> torch.Tensor:
        """Penalties and min-token bans. Returns `logits` itself (any dtype) when neither
        applies, else a new float32 tensor; the input is never modified."""
        if logits.shape[1] != self.state.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns but the sampling state was "
                             f"built for vocab_size={self.state.vocab_size}")
        if flags.any_penalty:
            logits = apply_penalties(logits.float(), slots, self.state)
        if flags.any_min_tokens:
            logits = apply_min_tokens(logits.float(), slots, self.state)
        return logits

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               slots_host: np.ndarray | Sequence[int] | None = None) -> SampleOutput:
        """logits [bs, vocab]; slots [bs]; positions [bs]: the sequence position of the token
        being sampled (the draw's counter). slots_host: the same slots on the host, to spare a
        device sync on GPUs."""
        if logits.shape[0] == 0:
            return SampleOutput(torch.empty(0, dtype=torch.long, device=logits.device))
        flags = self.batch_flags(slots, slots_host)
        logits = self.process_logits(logits, slots, flags)
        if flags.all_greedy:
            return self._with_logprobs(logits.argmax(-1), logits, flags.max_logprobs)
        st = self.state
        fp, ip = st.float_params[slots], st.int_params[slots]
        scaled = logits / fp[:, _F_TEMP, None]  # greedy rows hold T = 1
        tokens = self._draw(scaled, fp, ip, positions, flags)
        if flags.any_greedy:
            tokens = torch.where(ip[:, _I_GREEDY].bool(), logits.argmax(-1), tokens)
        return self._with_logprobs(tokens, scaled, flags.max_logprobs)

    def _draw(self, scaled: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor,
              positions: torch.Tensor, flags: BatchFlags) -> torch.Tensor:
        """Gumbel-max over the tokens top-k, top-p and min-p leave, per row."""
        keys = row_keys(ip[:, _I_SEED], positions)
        if not (flags.any_top_k or flags.any_top_p):  # no ordering needed
            vals = scaled
            if flags.any_min_p:
                floor = scaled.amax(-1, keepdim=True) + fp[:, _F_LOG_MIN_P, None]
                vals = scaled.masked_fill(scaled < floor, -math.inf)
            noise = _gumbel_(_uniform_from_terms(keys, self._all_token_terms(scaled.shape[1])))
            return noise.add_(vals).argmax(-1)

        if flags.all_top_k:
            vals, ids = scaled.topk(flags.max_top_k, dim=-1)
        else:
            vals, ids = scaled.sort(dim=-1, descending=True)
        n = vals.shape[1]
        if flags.any_top_k:
            k = ip[:, _I_TOP_K]
            k = torch.where(k > 0, k, n)
            vals.masked_fill_(self._columns(n) >= k[:, None], -math.inf)
        if flags.any_top_p:  # keep a token while the mass before it is < top_p
            probs = vals.softmax(-1)
            mass_before = probs.cumsum(-1).sub_(probs)
            vals.masked_fill_(mass_before >= fp[:, _F_TOP_P, None], -math.inf)
        if flags.any_min_p:  # vals[:, 0] is the row's max
            vals.masked_fill_(vals < vals[:, :1] + fp[:, _F_LOG_MIN_P, None], -math.inf)
        noise = _gumbel_(_uniform_from_terms(keys, _token_terms(ids)))
        choice = noise.add_(vals).argmax(-1, keepdim=True)
        return ids.gather(1, choice).squeeze(1)

    def _with_logprobs(self, tokens: torch.Tensor, scaled: torch.Tensor, n: int) -> SampleOutput:
        if n < 0:
            return SampleOutput(tokens)
        logp = torch.log_softmax(scaled.float(), dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        if n == 0:
            return SampleOutput(tokens, chosen)
        top_lp, top_ids = logp.topk(n, dim=-1)
        return SampleOutput(tokens, chosen, top_ids, top_lp)

    def _all_token_terms(self, width: int) -> torch.Tensor:
        if self._vocab_terms is None or self._vocab_terms.shape[0] != width:
            ids = torch.arange(width, device=self.state.device)
            self._vocab_terms = _token_terms(ids)
        return self._vocab_terms

    def _columns(self, n: int) -> torch.Tensor:
        if self._arange is None or self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, self.state.vocab_size), device=self.state.device)
        return self._arange[:n]
