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
- a CPU with the C library, float32 logits -> every draw in C (gpu/cpu_sampling.py), over
  the tokens near each row's best; the cuts sort only those

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
from typing import Sequence

import numpy as np
import torch

from gpu import cpu_sampling
from gpu.sampling_state import (F_LOG_MIN_P, F_TEMP, F_TOP_P, I_GREEDY, I_SEED, I_TOP_K,
                                BatchFlags, DraftedBefore, SampleOutput, SamplingState,
                                apply_min_tokens, apply_penalties)
from gpu.seeded_random import gumbel_, row_keys, token_terms, uniform_from_terms
from gpu.sync_guard import expected_sync

class Sampler:
    def __init__(self, state: SamplingState):
        self.state = state
        self._all_terms: torch.Tensor | None = None  # token_terms(arange(vocab)), cached
        self._c_noise: bool | None = None  # noise from C (gpu/cpu_sampling.py); decided at
        # the first draw, so a process that only ever takes argmaxes never loads the library
        self._arange: torch.Tensor | None = None

    def batch_flags(self, slots: torch.Tensor, slots_host=None) -> BatchFlags:
        if slots_host is not None:
            host = np.asarray(slots_host, dtype=np.int64)
        else:  # on a GPU this syncs: the worker should pass the plan's slots as slots_host
            host = slots.cpu().numpy().astype(np.int64, copy=False)
        return self.state.batch_flags(host)

    def argmax_only(self, slots: torch.Tensor, slots_host=None) -> bool:
        """Whether `sample` would return the logits' argmax and nothing else (BatchFlags)."""
        return self.batch_flags(slots, slots_host).argmax_only

    def c_draw(self, slots: torch.Tensor, positions: torch.Tensor, flags: BatchFlags
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(temperatures, keys, greedy) per row where `sample` would draw
        argmax(logit / T + noise) in C (a CPU, `flags.noise_only`), for
        cpu_sampling.lm_head_draw / cut_draw; None elsewhere."""
        if not (flags.noise_only and self._noise_in_c()) or flags.all_greedy:
            return None
        fp, ip = self.state.float_params[slots], self.state.int_params[slots]
        return fp[:, F_TEMP], row_keys(ip[:, I_SEED], positions), ip[:, I_GREEDY]

    def _draws_in_c(self, logits: torch.Tensor) -> bool:
        """Whether `sample` draws from these (processed) logits in C, cpu_sampling.cut_draw:
        float32 ones on a CPU with the library."""
        return logits.dtype == torch.float32 and self._noise_in_c()

    def _noise_in_c(self) -> bool:
        if self._c_noise is None:
            self._c_noise = cpu_sampling.available(self.state.device)
        return self._c_noise

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
        if self._draws_in_c(logits):
            tokens = cpu_sampling.cut_draw(  # (greedy rows: the argmax)
                logits, fp[:, F_TEMP], row_keys(ip[:, I_SEED], positions), ip[:, I_GREEDY],
                cuts=None if flags.noise_only else (ip[:, I_TOP_K], fp[:, F_TOP_P],
                                                    fp[:, F_LOG_MIN_P]))
            if flags.max_logprobs < 0:
                return SampleOutput(tokens)
            return self._with_logprobs(tokens, logits / fp[:, F_TEMP, None], flags.max_logprobs)
        scaled = logits / fp[:, F_TEMP, None]  # greedy rows hold T = 1
        tokens = self.torch_draw(scaled, fp, ip, positions, flags)
        if flags.any_greedy:
            tokens = torch.where(ip[:, I_GREEDY].bool(), logits.argmax(-1), tokens)
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
        scaled = logits / self.state.float_params[slots][:, F_TEMP, None]  # greedy: T = 1
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
        scaled = (logits / fp[:, F_TEMP, None]).float()
        threshold, vals, ids = None, scaled, None
        if flags.any_top_k or flags.any_top_p:
            threshold, vals, ids = self._truncate(scaled, fp, ip, flags)
        if flags.any_min_p:
            row_max = scaled.amax(-1) if ids is None else vals[:, 0]
            floor = row_max + fp[:, F_LOG_MIN_P]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        if threshold is None:
            probs = torch.softmax(scaled, dim=-1)
        elif ids is None or self._draws_in_c(logits):  # (C keeps every tie at the threshold)
            probs = torch.softmax(scaled.masked_fill(scaled < threshold[:, None], -math.inf), -1)
        else:  # the draw runs over the candidate list: exactly its allowed members
            kept = vals.masked_fill(vals < threshold[:, None], -math.inf)
            probs = torch.zeros_like(scaled).scatter_(1, ids, torch.softmax(kept, dim=-1))
        if flags.any_greedy:
            probs = torch.where(ip[:, I_GREEDY].bool()[:, None], one_hot, probs)
        return probs

    def torch_draw(self, scaled: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor,
                   positions: torch.Tensor, flags: BatchFlags) -> torch.Tensor:
        """Gumbel-max over the tokens that top-k, top-p and min-p leave in each row, in torch
        (a GPU; a CPU without the C library or with bf16 logits; cpu_sampling.cut_draw's peer).

        Every filter keeps the tokens whose scaled logit is >= a per-row threshold, so the
        filters only have to find that threshold; the draw then runs either over a candidate
        list (the top K, when it holds every row's allowed set) or over the whole vocabulary.
        Noise belongs to the token id, so both give the same token."""
        keys = row_keys(ip[:, I_SEED], positions)
        threshold, vals, ids = None, scaled, None
        if flags.any_top_k or flags.any_top_p:
            threshold, vals, ids = self._truncate(scaled, fp, ip, flags)
        if flags.any_min_p:  # relative to the row's max; renormalisation does not change it
            row_max = scaled.amax(-1) if ids is None else vals[:, 0]
            floor = row_max + fp[:, F_LOG_MIN_P]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        if self._noise_in_c():  # the same noise as cut_draw's, one pass
            scores = cpu_sampling.gumbel_noise(keys, ids, scaled.shape[1] if ids is None
                                               else ids.shape[1])
        else:
            terms = self._vocab_terms(scaled.shape[1]) if ids is None else token_terms(ids)
            scores = gumbel_(uniform_from_terms(keys, terms))
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
        top_k = ip[:, I_TOP_K]
        has_k = top_k > 0
        keep = torch.where(has_k, top_k.clamp(max=width), width)  # tokens kept, per row
        truncated = has_k
        covered = None
        if flags.any_top_p:
            top_p = fp[:, F_TOP_P]
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
            self._all_terms = token_terms(torch.arange(width, device=self.state.device))
        return self._all_terms

    def _columns(self, n: int) -> torch.Tensor:
        if self._arange is None or self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, self.state.vocab_size), device=self.state.device)
        return self._arange[:n]
