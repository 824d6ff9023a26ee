"""Batched sampling with per-request parameters, indexed by request slot.

Every parameter lives in a device table with one row per request slot, written once when the
request is admitted (`SamplingState.set_request`), so a step's only input besides the logits is
the batch's slots. Host mirrors of the same parameters pick the path for a batch without
touching the device, and nothing loops over the batch in Python:

- every row greedy                   -> one argmax (the common case; no float copy)
- no row has penalties / min tokens  -> those gathers are skipped
- temperature (and min_p) only       -> no sort: Gumbel-max over the vocabulary
- every sampled row has top_k > 0    -> ``torch.topk(max_k)``, and the draw runs over those
- top_p without top_k everywhere     -> full sort on GPUs; on CPUs (where sorting 32 x 49152
  takes over 100 ms) ``topk(256)``, then ``topk(4096)``, then a sort, until the top-p cut falls
  inside the candidates

All filters keep the tokens whose scaled logit is >= a per-row threshold (order: top-k, top-p
over the survivors, min-p relative to the max, as HF and SGLang), so ties at a cut are kept.

Randomness: no shared ``torch.Generator``. A draw hashes ``(seed, position, token id)`` into a
uniform ``u`` with integer tensor ops (splitmix64 in int64 for the per-row key, murmur3's fmix32
in int32 per token) and samples by Gumbel-max, ``argmax(logit / T - log(-log u))`` over the
allowed tokens. A token's noise depends only on its own request's seed, the position being
sampled and the token id, so a seeded request draws the same tokens alone or in any batch, in
any order, whichever path the batch takes.

Logprobs are those of the distribution the sampler draws from before truncation:
``log_softmax(penalised_logits / T)``, ahead of top-k / top-p / min-p, so the top-n alternatives
stay finite. Greedy rows (temperature 0 or top_k 1) report them at T = 1. (vLLM's default is the
raw model distribution; with no penalties and T = 1 the two agree.)

The sampler does not count its own outputs: the worker calls `SamplingState.record_outputs`
with the tokens it keeps (all of them, or the accepted ones under speculation).
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu.device import host_to_device
from gpu.sync_guard import expected_sync
from ipc.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------
# Counter-based random numbers. A draw (seed, position, stream) gets a 64-bit key from two
# rounds of splitmix64 in int64 ([bs] elements: cheap); each token then mixes its id with the
# key's low 32 bits through murmur3's fmix32 in int32, because the per-token work runs over up
# to [bs, vocab] elements and 32-bit ops cost half as much. Integer multiplication wraps.


def _wrap(x: int, bits: int) -> int:
    x &= (1 << bits) - 1
    return x - (1 << bits) if x >= 1 << (bits - 1) else x


_GOLDEN64 = _wrap(0x9E3779B97F4A7C15, 64)
_MIX64_1 = _wrap(0xBF58476D1CE4E5B9, 64)
_MIX64_2 = _wrap(0x94D049BB133111EB, 64)
_GOLDEN32 = _wrap(0x9E3779B9, 32)
_FMIX32_1 = _wrap(0x85EBCA6B, 32)
_FMIX32_2 = _wrap(0xC2B2AE35, 32)


def _shr(z: torch.Tensor, s: int, bits: int) -> torch.Tensor:
    """Logical right shift: torch's ``>>`` is arithmetic, so mask the sign copies off."""
    return (z >> s).bitwise_and_((1 << (bits - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place on int64."""
    z.bitwise_xor_(_shr(z, 30, 64)).mul_(_MIX64_1)
    z.bitwise_xor_(_shr(z, 27, 64)).mul_(_MIX64_2)
    return z.bitwise_xor_(_shr(z, 31, 64))


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser, in place on int32."""
    h.bitwise_xor_(_shr(h, 16, 32)).mul_(_FMIX32_1)
    h.bitwise_xor_(_shr(h, 13, 32)).mul_(_FMIX32_2)
    return h.bitwise_xor_(_shr(h, 16, 32))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One int64 key per draw. `stream` separates independent uses of the same (seed,
    position): token sampling is stream 0; speculative acceptance can use stream 1."""
    z = seeds.long() + _wrap((stream + 1) * 0x9E3779B97F4A7C15, 64)
    _mix64_(z)
    z += (positions.long() + 1) * _GOLDEN64
    return _mix64_(z)


def _token_terms(token_ids: torch.Tensor) -> torch.Tensor:
    return (token_ids.int() + 1).mul_(_GOLDEN32)


def _uniform_from_terms(keys: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [2**-24, 1 - 2**-24] (so -log(-log u) is finite), one per term."""
    h = _fmix32_(terms ^ keys.to(torch.int32)[:, None])  # the key's low 32 bits
    # The top 23 bits, signed: [-2**22, 2**22) -> exact in float32 -> centred in (0, 1).
    return (h >> 9).float().add_(2.0**22 + 0.5).mul_(2.0**-23)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                   stream: int = 0) -> torch.Tensor:
    """Uniform(0, 1) per (row, column), a pure function of (seed, position, token id, stream).
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
    all_truncated: bool  # every sampled row has top_k or top_p: a short candidate list may do
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int  # -1: no row wants logprobs


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
        seed = params.seed if params.seed is not None else secrets.randbits(63)
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
            self.min_tokens_ban[slot, self._to_device(torch.tensor(banned))] = True

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
        self.prompt_seen[slot, ids] = True

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
        return self.int_params[slots, _I_SEED]

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
    rep = fp[:, _F_REP, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - fp[:, _F_FREQ, None] * counts - fp[:, _F_PRES, None] * generated


def apply_min_tokens(logits: torch.Tensor, slots: torch.Tensor, state: SamplingState,
                     drafted: DraftedBefore | None = None) -> torch.Tensor:
    """Ban eos / stop ids for rows that have generated fewer than min_new_tokens (counting
    `drafted`, the outputs before each row's token that the slot's count lacks yet)."""
    assert state.min_tokens_ban is not None
    generated = state.generated_len[slots]
    if drafted is not None:
        generated = generated + drafted.weights.long().sum(-1)
    too_early = generated < state.int_params[slots, _I_MIN_NEW]
    return logits.masked_fill(state.min_tokens_ban[slots] & too_early[:, None], -math.inf)


class Sampler:
    def __init__(self, state: SamplingState):
        self.state = state
        self._all_terms: torch.Tensor | None = None  # _token_terms(arange(vocab)), cached
        self._arange: torch.Tensor | None = None

    def batch_flags(self, slots: torch.Tensor, slots_host=None) -> BatchFlags:
        if slots_host is not None:
            host = np.asarray(slots_host, dtype=np.int64)
        else:  # on a GPU this syncs: the worker should pass the plan's slots as slots_host
            host = slots.cpu().numpy().astype(np.int64, copy=False)
        return self.state.batch_flags(host)

    def process_logits(self, logits: torch.Tensor, slots: torch.Tensor, flags: BatchFlags,
                       drafted: DraftedBefore | None = None) -> torch.Tensor:
        """Penalties and min-token bans. Returns `logits` itself (any dtype) when neither
        applies, else a new float32 tensor; the input is never modified. `drafted`: per row,
        outputs before its token not counted in its slot yet (speculative verify)."""
        if logits.shape[1] != self.state.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns but the sampling state was "
                             f"built for vocab_size={self.state.vocab_size}")
        if flags.any_penalty:
            logits = apply_penalties(logits.float(), slots, self.state, drafted)
        if flags.any_min_tokens:
            logits = apply_min_tokens(logits.float(), slots, self.state, drafted)
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

    @torch.no_grad()
    def logprobs_of(self, logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                    slots_host: np.ndarray | Sequence[int] | None = None,
                    drafted: DraftedBefore | None = None) -> SampleOutput:
        """The logprobs `sample` would report had it drawn `tokens` from these rows (penalties,
        min-token bans, temperature; before the top-k/top-p cut): for tokens chosen elsewhere,
        e.g. by speculative acceptance. Only `tokens` when no row asks for logprobs."""
        flags = self.batch_flags(slots, slots_host)
        if flags.max_logprobs < 0 or logits.shape[0] == 0:
            return SampleOutput(tokens)
        logits = self.process_logits(logits, slots, flags, drafted)
        scaled = logits / self.state.float_params[slots][:, _F_TEMP, None]  # greedy: T = 1
        return self._with_logprobs(tokens, scaled, flags.max_logprobs)

    @torch.no_grad()
    def target_probs(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     slots_host: np.ndarray | Sequence[int] | None = None,
                     drafted: DraftedBefore | None = None) -> torch.Tensor:
        """The exact distribution `sample` draws from for these rows, float32 [n, vocab]:
        penalties and min-token bans, temperature, then the top-k / top-p / min-p cut with the
        sampler's own thresholds and candidate list (so ties at a cut resolve the same way),
        renormalised. Greedy rows get a one-hot at the argmax. For speculative acceptance
        (`gpu.eagle.accept.accept_sampling`), whose residual draw uses the same noise.
        positions is unused (the distribution does not depend on it); it keeps the signature
        parallel to `sample`. `drafted`: per row, outputs before its token not counted in its
        slot yet (a verify-tree node's drafts on its path)."""
        del positions
        n, vocab = logits.shape
        if n == 0:
            return torch.empty(0, vocab, dtype=torch.float32, device=logits.device)
        flags = self.batch_flags(slots, slots_host)
        logits = self.process_logits(logits, slots, flags, drafted)
        argmax = logits.argmax(-1)
        one_hot = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
        one_hot.scatter_(1, argmax[:, None], 1.0)
        if flags.all_greedy:
            return one_hot
        st = self.state
        fp, ip = st.float_params[slots], st.int_params[slots]
        scaled = (logits / fp[:, _F_TEMP, None]).float()
        threshold, vals, ids = None, scaled, None
        if flags.any_top_k or flags.any_top_p:
            threshold, vals, ids = self._truncate(scaled, fp, ip, flags)
        if flags.any_min_p:
            row_max = scaled.amax(-1) if ids is None else vals[:, 0]
            floor = row_max + fp[:, _F_LOG_MIN_P]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        if threshold is None:
            probs = torch.softmax(scaled, dim=-1)
        elif ids is None:
            probs = torch.softmax(scaled.masked_fill(scaled < threshold[:, None], -math.inf), -1)
        else:  # the draw runs over the candidate list: exactly its allowed members
            kept = vals.masked_fill(vals < threshold[:, None], -math.inf)
            probs = torch.zeros_like(scaled).scatter_(1, ids, torch.softmax(kept, dim=-1))
        if flags.any_greedy:
            probs = torch.where(ip[:, _I_GREEDY].bool()[:, None], one_hot, probs)
        return probs

    def _draw(self, scaled: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor,
              positions: torch.Tensor, flags: BatchFlags) -> torch.Tensor:
        """Gumbel-max over the tokens that top-k, top-p and min-p leave in each row.

        Every filter keeps the tokens whose scaled logit is >= a per-row threshold, so the
        filters only have to find that threshold; the draw then runs either over a candidate
        list (the top K, when it holds every row's allowed set) or over the whole vocabulary.
        Noise belongs to the token id, so both give the same token."""
        keys = row_keys(ip[:, _I_SEED], positions)
        threshold, vals, ids = None, scaled, None
        if flags.any_top_k or flags.any_top_p:
            threshold, vals, ids = self._truncate(scaled, fp, ip, flags)
        if flags.any_min_p:  # relative to the row's max; renormalisation does not change it
            row_max = scaled.amax(-1) if ids is None else vals[:, 0]
            floor = row_max + fp[:, _F_LOG_MIN_P]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        terms = self._vocab_terms(scaled.shape[1]) if ids is None else _token_terms(ids)
        scores = _gumbel_(_uniform_from_terms(keys, terms))
        if threshold is not None:
            vals = vals.masked_fill(vals < threshold[:, None], -math.inf)
        choice = scores.add_(vals).argmax(-1, keepdim=True)
        return choice.squeeze(1) if ids is None else ids.gather(1, choice).squeeze(1)

    def _truncate(self, scaled: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor,
                  flags: BatchFlags):
        """Per-row top-k / top-p threshold (-inf where a row has neither), and the candidate
        list (vals, ids) to draw from, or (scaled, None) when some row needs the whole
        vocabulary. A full sort is slow on CPUs (over 100 ms for 32 x 49152), so there the
        top-p cut is first sought in the top 256, then the top 4096; the device sync that
        checks it is free on a CPU."""
        vocab = scaled.shape[1]
        if flags.all_top_k or not flags.any_top_p:  # the top max_k decide every cut
            widths = [flags.max_top_k]
        elif self.state.device.type == "cpu":
            first = max(256, flags.max_top_k)
            widths = [w for w in dict.fromkeys((first, 4096)) if first <= w < vocab] + [vocab]
        else:
            widths = [vocab]
        for width in widths:
            if width < vocab:
                vals, ids = scaled.topk(width, dim=-1)
            else:
                vals, ids = scaled.sort(dim=-1, descending=True)
            threshold, covered = self._cut(scaled, vals, fp, ip, flags)
            if covered is None or width == vocab:
                break
            with expected_sync():  # narrower widths than the vocab: the CPU only (above)
                if bool(covered.all()):
                    break
        if not (flags.all_top_k or width == vocab or flags.all_truncated):
            return threshold, scaled, None  # some row keeps tokens outside the candidates
        return threshold, vals, ids

    def _cut(self, scaled: torch.Tensor, vals: torch.Tensor, fp: torch.Tensor,
             ip: torch.Tensor, flags: BatchFlags):
        """Threshold from candidates vals (sorted, descending); `covered` says per row whether
        the candidates decide its top-p cut (None when no row needs checking)."""
        width = vals.shape[1]
        top_k = ip[:, _I_TOP_K]
        has_k = top_k > 0
        keep = torch.where(has_k, top_k.clamp(max=width), width)  # tokens kept, per row
        truncated = has_k
        covered = None
        if flags.any_top_p:
            top_p = fp[:, _F_TOP_P]
            has_p = top_p < math.inf
            truncated = has_k | has_p
            in_k = vals.masked_fill(self._columns(width) >= keep[:, None], -math.inf)
            # top-p after top-k renormalises over the top k (HF); alone it is over the vocab.
            norm = in_k.logsumexp(-1)
            if not flags.all_top_k:
                norm = torch.where(has_k, norm, scaled.logsumexp(-1))
            probs = (in_k - norm[:, None]).exp_()
            mass = probs.cumsum(-1)
            mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # exactly monotone
            keep = torch.minimum(keep, (mass_before < top_p[:, None]).sum(-1))
            if not flags.all_top_k:  # rows without top_k need the cut inside the candidates
                covered = has_k | ~has_p | (mass[:, -1] >= top_p)
        threshold = vals.gather(1, (keep - 1)[:, None]).squeeze(1)
        return threshold.masked_fill_(~truncated, -math.inf), covered

    def _with_logprobs(self, tokens: torch.Tensor, scaled: torch.Tensor, n: int) -> SampleOutput:
        if n < 0:
            return SampleOutput(tokens)
        logp = torch.log_softmax(scaled.float(), dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        if n == 0:
            return SampleOutput(tokens, chosen)
        top_lp, top_ids = logp.topk(n, dim=-1)
        return SampleOutput(tokens, chosen, top_ids, top_lp)

    def _vocab_terms(self, width: int) -> torch.Tensor:
        if self._all_terms is None or self._all_terms.shape[0] != width:
            self._all_terms = _token_terms(torch.arange(width, device=self.state.device))
        return self._all_terms

    def _columns(self, n: int) -> torch.Tensor:
        if self._arange is None or self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, self.state.vocab_size), device=self.state.device)
        return self._arange[:n]
