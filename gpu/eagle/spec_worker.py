"""The EAGLE step ("spec v2" shape) on top of a ModelRunner.

Prefill:  target forward (capturing the draft's input states) -> sample -> draft extend over the
          chunk -> stash (bonus token, draft top-k, draft hidden) -> publish lengths.
Decode:   resolve (root token, lengths, draft relay) -> draft `num_steps` levels -> verify the
          tree in one target forward -> accept -> compact the accepted path's KV (trees) ->
          publish new lengths -> draft extend over the accepted tokens -> stash.

Every running request's state crosses steps through the FutureMap, so a plan never carries a
sequence length or a token for a decoding request, and plan k+1 may be built before step k's
result is known. Shapes are static per step (the draft extend always covers num_steps + 1
positions, the verify tree always num_draft_tokens nodes), so nothing here needs the accept
lengths on the host except the result message itself.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu.eagle.accept import AcceptResult, accept_greedy, accept_sampling
from gpu.eagle.draft_head import DraftHead
from gpu.eagle.head_io import load_draft_head
from gpu.eagle.tree import DraftTree, organize_draft_tree
from gpu.device import host_to_device
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool
from gpu.q4_linear import q4_applies
from gpu.sampler import DraftedBefore
from gpu.sync_guard import expected_sync
from ipc.spec_settings import SpecSettings
from ipc.worker_messages import (ExtendEntry, StepPlan, StepResult, pack_f32, pack_i32,
                                 unpack_i32)

if TYPE_CHECKING:
    from gpu.model_runner import ModelRunner

_SEED_COLUMN = 1  # SamplingState.int_params column of the seed


def hidden_size_for(worker: "EagleWorker | ModelRunner") -> int:
    """Width of the target hidden states a worker hands its draft head: the concatenation of
    the captured layers for EAGLE-3, the final hidden state otherwise. The one place this width
    is computed; idle batches build their empty tensors from it."""
    eagle = getattr(worker, "eagle", worker)
    if isinstance(eagle, EagleWorker):
        return eagle.head.config.input_hidden_size
    return worker.model_config.hidden_size


@dataclasses.dataclass
class _Part:
    """One part of a step (prefill rows, verify rows or plain decode rows): its slots on the
    host and what it emits as device tensors, copied to the host while the next step is
    planned. `outputs`: "tokens" [rows] (one token per row) or [rows, E] (verify rows, with
    "accept" [rows]); when some row asked for logprobs, per candidate token "logprobs" and
    the top n "top_ids" / "top_logprobs" [candidates, n]."""

    slots: np.ndarray
    outputs: dict[str, torch.Tensor]
    verify: bool = False


@dataclasses.dataclass
class _Rows:
    """What one part of a step emits, on the host, row by row."""

    slots: np.ndarray  # [rows]
    tokens: list[np.ndarray]  # per row, the emitted tokens
    accept_lens: np.ndarray  # [rows], -1 for a prefill row
    # Per emitted token, when some row of this part asked for logprobs: the token's, and the
    # top n (ids, logprobs) [tokens, n] with n this part's largest ask (0: none).
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    @classmethod
    def of(cls, part: _Part, host: dict[str, np.ndarray]) -> "_Rows":
        tokens = host["tokens"]
        if part.verify:
            acc = host["accept"]
            rows = cls(part.slots, [tokens[i, :a + 1] for i, a in enumerate(acc)], acc)
            emitted = (np.arange(tokens.shape[1])[None, :] <= acc[:, None]).reshape(-1)
        else:
            rows = cls(part.slots, [tokens[i:i + 1] for i in range(len(tokens))],
                       np.full(len(tokens), -1, dtype=np.int64))
            emitted = np.ones(len(tokens), dtype=bool)
        if "logprobs" in host:
            rows.logprobs = host["logprobs"].reshape(-1)[emitted]
            if "top_ids" in host:
                n = host["top_ids"].shape[-1]
                rows.top_ids = host["top_ids"].reshape(-1, n)[emitted]
                rows.top_logprobs = host["top_logprobs"].reshape(-1, n)[emitted]
        return rows

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def _logprob_outputs(out) -> dict[str, torch.Tensor]:
    """A SampleOutput's logprob tensors, by their _Part.outputs names (none if not asked)."""
    if out is None or out.logprobs is None:
        return {}
    found = {"logprobs": out.logprobs.float()}
    if out.top_logprob_ids is not None and out.top_logprob_ids.shape[-1]:
        found["top_ids"] = out.top_logprob_ids
        found["top_logprobs"] = out.top_logprobs.float()
    return found


class EagleWorker:
    def __init__(self, runner: "ModelRunner", settings: SpecSettings) -> None:
        settings.validate()
        if not settings.draft_model:
            raise ValueError("speculative decoding needs a draft head: set spec.draft_model to "
                             "an EAGLE head directory (config.json + safetensors)")
        self.runner = runner
        self.settings = settings
        mc = runner.model_config
        model = runner.model
        lm_head = model.embed_tokens if mc.tie_word_embeddings else getattr(
            model.lm_head, "weight", None)
        if lm_head is None and settings.algorithm == "eagle":
            raise ValueError("an EAGLE-1 head scores with the target's lm_head, which this "
                             "runner keeps only in compressed form: use weight_quant = none")
        self.head: DraftHead = load_draft_head(settings.draft_model, mc, model.embed_tokens,
                                               lm_head, runner.device, runner.dtype)
        self.head.eval()
        # Where the target's small forwards run on the file's 4-bit codes, the head's run on
        # int8 copies of its weights (the draft step is one row per request at batch 1).
        if q4_applies(runner.device, runner.dtype, runner.cfg.q4_max_tokens):
            self.head.use_int8_for_small_forwards(runner.cfg.q4_max_tokens)
        hc = self.head.config
        if hc.algorithm != settings.algorithm:
            raise ValueError(f"spec.algorithm is '{settings.algorithm}' but the head in "
                             f"{settings.draft_model} is an '{hc.algorithm}' head")
        self.capture_layers = tuple(hc.capture_layers)
        from gpu.model_runner import make_attention_backend  # the runner imports this module
        self.draft_kv = KVPool(1, runner.kv_pool.num_pages, runner.cfg.page_size,
                               hc.num_kv_heads, hc.head_dim, runner.dtype, runner.device)
        self.draft_attn = make_attention_backend(runner.cfg.attention_backend, self.draft_kv,
                                                 runner.req_to_token, hc.num_heads,
                                                 hc.num_kv_heads, hc.head_dim)
        # Host lengths only if some backend in use (target or draft) needs them.
        runner.needs_cpu_seq_lens = (runner.attn.needs_cpu_seq_lens
                                     or self.draft_attn.needs_cpu_seq_lens)
        runner.future_map.enable_spec(settings.topk, hc.hidden_size, runner.dtype)
        self.max_position = min(runner.max_context_len, hc.max_position_embeddings) - 1
        # Lifetime acceptance counters, per draft position (for telemetry and benchmarks).
        self.num_verify_rows = 0
        self.accepted_per_position = np.zeros(settings.num_steps, dtype=np.int64)

    # -- batches ----------------------------------------------------------------------------

    def _batch(self, mode: ForwardMode, input_ids, positions, slots, prefix_lens, extend_lens,
               seq_lens, out_cache_loc, tree_mask=None) -> ForwardBatch:
        batch = ForwardBatch(mode=mode, input_ids=input_ids, positions=positions, slots=slots,
                             seq_lens=seq_lens, prefix_lens=prefix_lens, extend_lens=extend_lens,
                             out_cache_loc=out_cache_loc, tree_mask=tree_mask)
        self._host_lengths(batch)
        return batch

    def _host_lengths(self, batch: ForwardBatch) -> None:
        if batch.batch_size == 0:
            return
        batch.seq_lens_cpu, batch.seq_lens_sum = self.runner.future_map.resolve_seq_lens_cpu(
            batch.seq_lens, self.runner.needs_cpu_seq_lens)
        if batch.seq_lens_cpu is not None:
            with expected_sync():  # a backend in use declared it needs host lengths
                batch.prefix_lens_cpu = batch.prefix_lens.cpu()
                batch.extend_lens_cpu = batch.extend_lens.cpu()
                batch.max_seq_len = int(batch.seq_lens_cpu.max())
                batch.max_extend_len = int(batch.extend_lens_cpu.max())

    def _locs(self, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """KV locations of req_to_token[slots[i], index[i, j]], flattened."""
        return self.runner.req_to_token.req_to_token[slots[:, None], index].reshape(-1).long()

    def _target(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward; returns (final hidden, the draft's input features)."""
        r = self.runner
        if batch.batch_size:
            r.attn.init_forward_metadata(batch)
        hidden, captured = r.model.hidden_states(batch, r.attn, self.capture_layers)
        feats = torch.cat(captured, dim=-1) if captured else hidden
        return hidden, feats.view(-1, hidden_size_for(self))

    def _draft(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft head forward over `batch` (its KV goes to the draft pool at the same
        locations); returns (hidden fed back, hidden for logits)."""
        if batch.batch_size:
            self.draft_attn.init_forward_metadata(batch)
        attend = lambda q, k, v: self.draft_attn.forward(q, k, v, 0, batch)  # noqa: E731
        return self.head(batch.input_ids, hidden, batch.positions, attend)

    def _draft_topk(self, logits_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.head.logits(logits_hidden).float(), dim=-1)
        p, ids = probs.topk(self.settings.topk, dim=-1)
        return p, self.head.draft_to_target(ids)

    # -- the step ---------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> list[_Part]:
        """Enqueue one step (its bookkeeping already applied, ModelRunner.prepare): every
        kernel, the FutureMap's stash and publish, nothing that waits for the device, so the
        host can plan the next step while this one runs (tests/test_host_sync.py checks it).
        Returns the parts whose outputs `finish` turns into the result."""
        parts: list[_Part] = []
        if plan.extends:
            parts.append(self._prefill(plan.extends))
        decode_host = unpack_i32(plan.decode_slots).astype(np.int64)
        if len(decode_host) or not plan.extends:  # an empty plan runs the decode path idle
            parts.append(self._decode(decode_host))
        return parts

    @staticmethod
    def outputs_of(parts: list[_Part]) -> dict[str, torch.Tensor]:
        """Every part's device outputs under one flat naming, for one host copy."""
        return {f"{i}/{name}": t for i, p in enumerate(parts) for name, t in p.outputs.items()}

    def finish(self, step_id: int, parts: list[_Part], host: dict[str, torch.Tensor]
               ) -> StepResult:
        """The step's result from its parts' outputs, landed on the host (timings left 0)."""
        rows = []
        for i, part in enumerate(parts):
            prefix = f"{i}/"
            mine = {k[len(prefix):]: v.numpy() for k, v in host.items() if k.startswith(prefix)}
            r = _Rows.of(part, mine)
            if part.verify:  # acceptance counters, per draft position
                self.num_verify_rows += len(r.accept_lens)
                for a in r.accept_lens:
                    self.accepted_per_position[:a] += 1
            rows.append(r)
        slots = np.concatenate([r.slots for r in rows])
        tokens = [t for r in rows for t in r.tokens]
        accept = np.concatenate([r.accept_lens for r in rows])
        logprobs, n_top, top_ids, top_lps = _merge_logprobs(rows)
        return StepResult(
            step_id=step_id, slots=pack_i32(slots),
            token_ids=pack_i32(np.concatenate(tokens) if tokens else np.zeros(0)),
            logprobs=logprobs, top_logprobs_n=n_top, top_logprob_ids=top_ids,
            top_logprobs=top_lps, forward_ms=0.0, accept_lens=pack_i32(accept))

    def _prefill(self, extends: list[ExtendEntry]) -> _Part:
        r, dev = self.runner, self.runner.device
        ids = [unpack_i32(e.token_ids) for e in extends]
        for e, chunk in zip(extends, ids):
            r.sampling_state.add_prefill_chunk(e.slot, chunk, e.prefix_len)
        # Checked on the host: the draft extend pairs each position with the next token.
        if any(not e.sample and e.next_token < 0 for e in extends):
            raise ValueError("a non-final prefill chunk came without next_token: the scheduler "
                             "must send one token of lookahead when speculating")
        lens_host = np.array([len(c) for c in ids], dtype=np.int64)
        total = int(lens_host.sum())
        lens = host_to_device(lens_host, dev)
        slots = host_to_device(np.array([e.slot for e in extends], dtype=np.int64), dev)
        prefix = host_to_device(np.array([e.prefix_len for e in extends], dtype=np.int64), dev)
        input_ids = host_to_device(np.concatenate(ids).astype(np.int64), dev)
        starts = torch.cumsum(lens, 0) - lens
        positions = (torch.arange(total, device=dev)
                     - torch.repeat_interleave(starts - prefix, lens, output_size=total))
        token_slots = torch.repeat_interleave(slots, lens, output_size=total)
        batch = self._batch(ForwardMode.EXTEND, input_ids, positions, slots, prefix, lens,
                            prefix + lens, r.req_to_token.req_to_token[token_slots, positions].long())
        hidden, feats = self._target(batch)
        r.future_map.publish(slots, batch.seq_lens)

        last = starts + lens - 1
        sample_host = np.array([i for i, e in enumerate(extends) if e.sample], dtype=np.int64)
        sample_rows = host_to_device(sample_host, dev)
        sample_slots = slots[sample_rows]
        slots_host = np.array([extends[i].slot for i in sample_host], dtype=np.int64)
        out = r.sampler.sample(r.model.logits(hidden[last[sample_rows]]), sample_slots,
                               batch.seq_lens[sample_rows], slots_host=slots_host)
        r.future_map.stash(sample_slots, out.token_ids)
        r.sampling_state.record_outputs(sample_slots, out.token_ids)

        # Draft extend: position t pairs the target's state at t with token t + 1.
        following = host_to_device(np.array([e.next_token for e in extends], dtype=np.int64),
                                   dev)
        following[sample_rows] = out.token_ids
        draft_ids = torch.empty_like(input_ids)
        draft_ids[:-1] = input_ids[1:]
        draft_ids[last] = following
        h_out, h_logits = self._draft(dataclasses.replace(batch, input_ids=draft_ids), feats)
        rows = last[sample_rows]
        topk_p, topk_ids = self._draft_topk(h_logits[rows])
        r.future_map.stash_spec(sample_slots, topk_p, topk_ids, h_out[rows])
        return _Part(slots_host, {"tokens": out.token_ids, **_logprob_outputs(out)})

    def _decode(self, slots_host: np.ndarray) -> _Part:
        r, s, dev = self.runner, self.settings, self.runner.device
        slots = host_to_device(slots_host, dev)
        bs, T, E = len(slots_host), s.num_draft_tokens, s.num_steps + 1
        fm = r.future_map
        seq_lens = fm.resolve_seq_lens(slots)  # L: tokens in the target's cache
        root = fm.resolve_future(slots)  # the last bonus token, at position L
        if s.disable_above_batch_size and bs > s.disable_above_batch_size:
            return self._decode_plain(slots, slots_host, seq_lens, root)
        topk_p, topk_ids, draft_hidden = fm.resolve_spec(slots)
        tree = self._draft_tree(slots, seq_lens, root, topk_p, topk_ids, draft_hidden)

        # Verify: node j's KV goes to index L + j; it sits at position L + depth(j).
        cols = torch.arange(T, device=dev)
        positions = (seq_lens[:, None] + tree.depth).clamp_(max=self.max_position)
        batch = self._batch(
            ForwardMode.EXTEND, tree.tokens.reshape(-1), positions.reshape(-1), slots,
            seq_lens, torch.full_like(seq_lens, T), seq_lens + T,
            self._locs(slots, seq_lens[:, None] + cols),
            tree.mask if s.topk > 1 else None)  # a chain is the ordinary causal extend
        hidden, feats = self._target(batch)
        logits = r.model.logits(hidden)  # [bs * T, V]
        result = self._accept(tree, logits, slots, slots_host, positions)
        acc = result.accept_lens
        new_lens = seq_lens + acc + 1
        if s.topk > 1:
            self._compact_kv(slots, seq_lens, result)
        fm.publish(slots, new_lens)
        fm.stash(slots, result.bonus_tokens)
        emitted = torch.arange(E, device=dev)[None, :] <= acc[:, None]  # [bs, E]
        out_tokens = _pad(result.accepted_tokens, E)
        # Static shapes: every candidate is counted, weighted by whether it was emitted.
        r.sampling_state.record_outputs(slots[:, None].expand(-1, E).reshape(-1),
                                        out_tokens.clamp(min=0).reshape(-1),
                                        weights=emitted.reshape(-1))

        # Draft extend over the accepted path (static width E; rows past the path are scratch).
        path = _pad(result.path, E).clamp(min=0)
        width = hidden_size_for(self)
        path_feats = feats.view(bs, T, width).gather(1, path[:, :, None].expand(-1, -1, width))
        ext = torch.arange(E, device=dev)
        draft_batch = self._batch(
            ForwardMode.EXTEND, out_tokens.clamp(min=0).reshape(-1),
            (seq_lens[:, None] + ext).clamp_(max=self.max_position).reshape(-1), slots, seq_lens,
            torch.full_like(seq_lens, E), seq_lens + E, self._locs(slots, seq_lens[:, None] + ext))
        h_out, h_logits = self._draft(draft_batch, path_feats.reshape(bs * E, width))
        last = torch.arange(bs, device=dev) * E + acc
        next_p, next_ids = self._draft_topk(h_logits[last])
        fm.stash_spec(slots, next_p, next_ids, h_out[last])

        # Logprobs of the emitted tokens, each from the logits of the node it follows (the
        # root, then the accepted drafts), as the plain step would report them; only when a
        # request asks (a host check: no gather of [bs * E, vocab] logits otherwise).
        scored = None
        if r.sampling_state.max_logprobs(slots_host) >= 0:
            node_rows = (torch.arange(bs, device=dev)[:, None] * T + path).reshape(-1)
            scored = r.sampler.logprobs_of(logits[node_rows], slots.repeat_interleave(E),
                                           out_tokens.clamp(min=0).reshape(-1),
                                           slots_host=np.repeat(slots_host, E),
                                           drafted=drafted_before(tree).rows(node_rows))
        return _Part(slots_host, {"tokens": out_tokens, "accept": acc,
                                  **_logprob_outputs(scored)}, verify=True)

    def _decode_plain(self, slots: torch.Tensor, slots_host: np.ndarray, seq_lens: torch.Tensor,
                      root: torch.Tensor) -> _Part:
        """A decode step without drafting, for a batch above spec.disable_above_batch_size
        (there the cores are busy already and a verify costs num_draft_tokens per request):
        the target decodes the root and samples the next token exactly as the plain engine
        does, then the draft extends over that one token, so its KV and the relayed top-k stay
        complete and a later, smaller batch speculates from where this one left off. Rows
        report accept length -1: not verify steps, left out of the acceptance statistics."""
        r, fm = self.runner, self.runner.future_map
        positions = seq_lens.clamp(max=self.max_position)
        locs = self._locs(slots, seq_lens[:, None])
        batch = self._batch(ForwardMode.DECODE, root, positions, slots, seq_lens,
                            torch.ones_like(seq_lens), seq_lens + 1, locs)
        hidden, feats = self._target(batch)
        out = r.sampler.sample(r.model.logits(hidden), slots, batch.seq_lens,
                               slots_host=slots_host)
        fm.publish(slots, batch.seq_lens)
        fm.stash(slots, out.token_ids)
        r.sampling_state.record_outputs(slots, out.token_ids)
        # Draft extend: the target's state at L paired with the token just sampled (L + 1);
        # the same positions, lengths and KV locations as the target's batch.
        h_out, h_logits = self._draft(dataclasses.replace(batch, input_ids=out.token_ids), feats)
        next_p, next_ids = self._draft_topk(h_logits)
        fm.stash_spec(slots, next_p, next_ids, h_out)
        return _Part(slots_host, {"tokens": out.token_ids, **_logprob_outputs(out)})

    def _draft_tree(self, slots, seq_lens, root, topk_p, topk_ids, hidden) -> DraftTree:
        """num_steps levels of drafting from the relayed top-k (SGLang's select_top_k_tokens):
        level 0 is the relayed top-k itself; each later level expands the `topk` best nodes
        of the previous one by cumulative probability. Expanded nodes of level i-1 run at
        position L + i - 1 with their draft KV at index L + (i - 1) * topk + row."""
        s, dev = self.settings, self.runner.device
        k, bs = s.topk, slots.shape[0]
        H = self.head.config.hidden_size
        scores = topk_p
        score_list = [topk_p[:, None, :]]
        token_list = [topk_ids]
        parents_list = [torch.arange(-1, k, device=dev).expand(bs, -1)]
        inputs = topk_ids.reshape(-1)
        hid = hidden.repeat_interleave(k, dim=0)
        ancestors = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)
        for i in range(1, s.num_steps):
            pos = (seq_lens + i - 1).clamp(max=self.max_position)
            if k == 1:
                batch = self._batch(ForwardMode.DECODE, inputs, pos, slots, seq_lens + i - 1,
                                    torch.ones_like(seq_lens), seq_lens + i,
                                    self._locs(slots, (seq_lens + i - 1)[:, None]))
            else:
                base = seq_lens[:, None] + (i - 1) * k
                batch = self._batch(ForwardMode.EXTEND, inputs, pos.repeat_interleave(k), slots,
                                    seq_lens, torch.full_like(seq_lens, k), seq_lens + i * k,
                                    self._locs(slots, base + torch.arange(k, device=dev)),
                                    ancestors)
            h_out, h_logits = self._draft(batch, hid)
            p, ids = self._draft_topk(h_logits)  # [bs * k, k]
            expand = scores[:, :, None] * p.view(bs, k, k)
            scores, best = expand.reshape(bs, k * k).topk(k, dim=-1)
            ids = ids.view(bs, k * k)
            score_list.append(expand)
            token_list.append(ids)
            parents_list.append(best + k * k * (i - 1) + k)
            inputs = ids.gather(1, best).reshape(-1)
            parent_row = best // k
            hid = h_out.view(bs, k, H).gather(1, parent_row[:, :, None].expand(-1, -1, H)
                                              ).reshape(bs * k, H)
            width = ancestors.shape[2]
            ancestors = torch.cat([
                ancestors.gather(1, parent_row[:, :, None].expand(-1, -1, width)),
                torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)], dim=2)
        return organize_draft_tree(score_list, token_list, parents_list, root,
                                   s.num_draft_tokens)

    def _accept(self, tree: DraftTree, logits: torch.Tensor, slots: torch.Tensor,
                slots_host: np.ndarray, positions: torch.Tensor) -> AcceptResult:
        r = self.runner
        bs, T = tree.tokens.shape
        node_slots = slots.repeat_interleave(T)
        node_host = np.repeat(slots_host, T)
        flags = r.sampler.batch_flags(node_slots, node_host)
        # A node samples the token after the drafts on its path: the penalties and the
        # min_new_tokens ban count them, as plain decoding would have by then.
        drafted = drafted_before(tree) if flags.any_penalty or flags.any_min_tokens else None
        if flags.all_greedy:
            processed = r.sampler.process_logits(logits, node_slots, flags, drafted)
            return accept_greedy(tree, processed.argmax(-1).view(bs, T))
        following = (positions + 1).reshape(-1)  # the position the next token takes
        probs = r.sampler.target_probs(logits, node_slots, following, slots_host=node_host,
                                       drafted=drafted)
        seeds = r.sampling_state.int_params[slots, _SEED_COLUMN]
        return accept_sampling(tree, probs.view(bs, T, -1), seeds, positions + 1)

    def _compact_kv(self, slots: torch.Tensor, seq_lens: torch.Tensor,
                    result: AcceptResult) -> None:
        """Move the accepted nodes' target KV from index L + column to L + depth. Static
        shapes (no host sync): every depth is copied; one off the path, or already in place,
        copies its own KV onto itself (all reads happen before the writes)."""
        path = result.path[:, 1:]  # depth 1.. (the root is already at L)
        depth = torch.arange(1, path.shape[1] + 1, device=path.device).expand_as(path)
        src_col = torch.where(path >= 0, path, depth)
        rows = slots[:, None].expand_as(path)
        table = self.runner.req_to_token.req_to_token
        src = table[rows, seq_lens[:, None] + src_col].long().reshape(-1)
        dst = table[rows, seq_lens[:, None] + depth].long().reshape(-1)
        pool = self.runner.kv_pool
        for layer in range(len(pool.k_buffer)):
            pool.k_buffer[layer][dst] = pool.k_buffer[layer][src]
            pool.v_buffer[layer][dst] = pool.v_buffer[layer][src]


def drafted_before(tree: DraftTree) -> DraftedBefore:
    """Per tree node (row b * T + j), the drafts on its path from the root, itself included:
    the outputs that come before the token node j's logits sample. The root's own token was
    counted when it was emitted (it is the previous step's bonus)."""
    bs, t = tree.tokens.shape
    tokens = tree.tokens[:, None, 1:].expand(bs, t, t - 1).reshape(bs * t, t - 1)
    return DraftedBefore(tokens.clamp(min=0), tree.mask[:, :, 1:].reshape(bs * t, t - 1))


def _merge_logprobs(parts: list[_Rows]) -> tuple[bytes, int, bytes, bytes]:
    """The step's logprob buffers over every part's tokens (empty when no part has any). A
    part without them, or with fewer top entries, is padded with NaN / -1: only requests that
    asked read them, and a request asks in the part it runs in for at most that part's n."""
    if all(p.logprobs is None for p in parts):
        return b"", 0, b"", b""
    n = max(0 if p.top_ids is None else p.top_ids.shape[1] for p in parts)
    lps, ids, tops = [], [], []
    for p in parts:
        k = p.num_tokens
        lps.append(p.logprobs if p.logprobs is not None else np.full(k, np.nan, np.float32))
        if n:
            have = 0 if p.top_ids is None else p.top_ids.shape[1]
            pad = ((0, 0), (0, n - have))
            ids.append(np.pad(p.top_ids if have else np.zeros((k, 0), np.int64), pad,
                              constant_values=-1))
            tops.append(np.pad(p.top_logprobs if have else np.zeros((k, 0), np.float32), pad,
                               constant_values=np.nan))
    return (pack_f32(np.concatenate(lps)), n, pack_i32(np.concatenate(ids)) if n else b"",
            pack_f32(np.concatenate(tops)) if n else b"")


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [bs, w] padded with -1 (or cut) to [bs, width]."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)
