"""The draft side of an EAGLE step: the head, its own one-layer KV pool, and the batches both
the head and the target's verify forwards run on.

`SpecBatches` builds ForwardBatches from device tensors (host lengths only where a backend in
use asks for them). `Drafter` runs the head: a forward over a batch, its top-k, and the
`num_steps`-level draft tree of a decode step.
"""

from __future__ import annotations

import torch

from gpu.attention.factory import make_attention_backend
from gpu.eagle.draft_head import DraftHead
from gpu.eagle.head_io import load_draft_head
from gpu.eagle.head_native import NativeHead, why_not as why_not_native
from gpu.eagle.tree import DraftTree, chain_tree, organize_draft_tree
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool
from gpu.cpu_q4_kernel import available as codes_kernel_available
from gpu.q4_linear import q4_applies
from gpu.sync_guard import expected_sync
from gpu.worker_state import WorkerState
from ipc.spec_settings import SpecSettings


class SpecBatches:
    """Batches of an EAGLE step: every shape is static, lengths stay on the device."""

    def __init__(self, state: WorkerState, needs_cpu_seq_lens: bool) -> None:
        self.state = state
        self.needs_cpu_seq_lens = needs_cpu_seq_lens

    def make(self, mode: ForwardMode, input_ids, positions, slots, prefix_lens, extend_lens,
             seq_lens, out_cache_loc, tree_mask=None) -> ForwardBatch:
        batch = ForwardBatch(mode=mode, input_ids=input_ids, positions=positions, slots=slots,
                             seq_lens=seq_lens, prefix_lens=prefix_lens, extend_lens=extend_lens,
                             out_cache_loc=out_cache_loc, tree_mask=tree_mask)
        if batch.batch_size == 0:
            return batch
        batch.seq_lens_cpu, batch.seq_lens_sum = self.state.future_map.resolve_seq_lens_cpu(
            batch.seq_lens, self.needs_cpu_seq_lens)
        if batch.seq_lens_cpu is not None:
            with expected_sync():  # a backend in use declared it needs host lengths
                batch.prefix_lens_cpu = batch.prefix_lens.cpu()
                batch.extend_lens_cpu = batch.extend_lens.cpu()
                batch.max_seq_len = int(batch.seq_lens_cpu.max())
                batch.max_extend_len = int(batch.extend_lens_cpu.max())
        return batch

    def locs(self, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """KV locations of req_to_token[slots[i], index[i, j]], flattened."""
        return self.state.req_to_token.req_to_token[slots[:, None], index].reshape(-1).long()


class Drafter:
    def __init__(self, state: WorkerState, settings: SpecSettings) -> None:
        if not settings.draft_model:
            raise ValueError("speculative decoding needs a draft head: set spec.draft_model to "
                             "an EAGLE head directory (config.json + safetensors)")
        self.settings = settings
        self.chain = settings.topk == 1 and settings.num_draft_tokens == settings.num_steps + 1
        mc, model = state.model_config, state.model
        # A tied table the target keeps as its Q8_0 codes only (gpu/llama.py): the head embeds
        # and scores through the target's own lookup and lm_head, not a table copy.
        codes_only = model.embed_codes is not None
        lm_head = None if codes_only else model.embed_tokens if mc.tie_word_embeddings else \
            getattr(model.lm_head, "weight", None)
        if (lm_head is None and settings.algorithm == "eagle" and state.shard is None
                and not codes_only):
            raise ValueError("an EAGLE-1 head scores with the target's lm_head, which this "
                             "worker keeps only in compressed form: use weight_quant = none")
        # Under TP the head runs whole on every rank, on the same inputs (the target's
        # captured states are whole after its all-reduces), so every rank drafts the same
        # tree with no broadcast; only the vocabulary-split target tables are reached through
        # the target's layers. An EAGLE-3 head's own lm_head (the draft vocabulary) is
        # replicated. With codes only, the head never sees a table: `model.embed_tokens`
        # would dequantize one (~108 MB for the default model) just to be dropped.
        through_layers = state.shard is not None or codes_only
        self.head: DraftHead = load_draft_head(
            settings.draft_model, mc, None if through_layers else model.embed_tokens,
            None if through_layers else lm_head, state.device, state.dtype,
            parallel_target=(model.embed, model.lm_head) if through_layers else None)
        self.head.eval()
        # Where the target's small forwards run on the file's 4-bit codes, the head's run on
        # int8 copies of its weights (the draft step is one row per request at batch 1).
        q4_max_tokens = state.cfg.runtime.q4_max_tokens
        if q4_applies(state.device, state.dtype, q4_max_tokens):
            self.head.use_int8_for_small_forwards(q4_max_tokens)
        elif model.kernel_max_rows and codes_kernel_available():  # fp32 on the C kernel
            # Codes only, as the target's projections: wide forwards (a prompt, a catch-up)
            # dequantize a piece at a time; bf16 GEMMs where the target's run in bf16.
            split, exact = state.fp32_split, state.cfg.runtime.deterministic
            self.head.use_int8_for_small_forwards(
                model.kernel_max_rows, fp32_codes=True, codes_only=None if exact else
                "bf16" if split is not None and split.bf16_gemm else "fp32")
        elif state.device.type == "cpu" and state.dtype == torch.float32:
            self.head.use_dense_panels()  # an explicit fp32 engine: as the target's projections
        if state.cfg.runtime.deterministic:
            self.head.use_rowwise_linears()
        hc = self.head.config
        if hc.algorithm != settings.algorithm:
            raise ValueError(f"spec.algorithm is '{settings.algorithm}' but the head in "
                             f"{settings.draft_model} is an '{hc.algorithm}' head")
        self.draft_kv = KVPool(1, state.kv_pool.num_pages, state.page_size, hc.num_kv_heads,
                               hc.head_dim, state.dtype, state.device)
        self.draft_attn = make_attention_backend(state.attention_backend,
                                                 self.draft_kv, state.req_to_token,
                                                 hc.num_heads, hc.num_kv_heads, hc.head_dim,
                                                 deterministic=state.cfg.runtime.deterministic)
        self.max_position = min(state.max_context_len, hc.max_position_embeddings) - 1
        self.device = state.device
        self.idle_counts = state.idle_counts
        # Where its projections run on the C kernel's codes, the layer runs in C too (a
        # chain's few rows); not under TP, DP attention or deterministic mode, as the
        # target's decode step.
        self.native: NativeHead | None = None
        if (state.cfg.parallel.tp == 1 and state.dp_attention is None
                and not state.cfg.runtime.deterministic
                and why_not_native(self.head, self.draft_kv, self.draft_attn) is None):
            self.native = NativeHead(self.head, self.draft_kv, self.draft_attn,
                                     self.head.midlayer.self_attn.q_proj.max_rows)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft head forward over `batch` (its KV goes to the draft pool at the same
        locations); returns (hidden fed back, hidden for logits)."""
        if self.native is not None and self.native.can_run(batch):
            return self.native.forward(batch, hidden)
        if batch.batch_size:
            self.draft_attn.init_forward_metadata(batch)
        else:
            self.idle_counts["draft"] += 1
        attend = lambda q, k, v: self.draft_attn.forward(q, k, v, 0, batch)  # noqa: E731
        return self.head(batch.input_ids, hidden, batch.positions, attend)

    def topk(self, logits_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's `topk` best tokens (target ids) and their probabilities. A chain ranks
        nothing by them, so there its one token is the argmax, in C where the head's lm_head
        runs on codes (the probability then reads 1: unused)."""
        if self.chain:
            ids = self.head.greedy_ids(logits_hidden)
            if ids is not None:
                return (torch.ones(ids.shape[0], 1, device=ids.device),
                        self.head.draft_to_target(ids[:, None]))
        probs = torch.softmax(self.head.logits(logits_hidden).float(), dim=-1)
        p, ids = probs.topk(self.settings.topk, dim=-1)
        return p, self.head.draft_to_target(ids)

    def tree(self, batches: SpecBatches, slots, seq_lens, root, topk_p, topk_ids, hidden
             ) -> DraftTree:
        """num_steps levels of drafting from the relayed top-k (SGLang's select_top_k_tokens):
        level 0 is the relayed top-k itself; each later level expands the `topk` best nodes
        of the previous one by cumulative probability. Expanded nodes of level i-1 run at
        position L + i - 1 with their draft KV at index L + (i - 1) * topk + row."""
        if self.chain:
            return self._chain(batches, slots, seq_lens, root, topk_ids, hidden)
        s, dev = self.settings, self.device
        k, bs = s.topk, slots.shape[0]
        H = self.head.config.hidden_size
        scores = topk_p
        score_list = [topk_p[:, None, :]]
        token_list = [topk_ids]
        parents_list = [torch.arange(-1, k, device=dev).expand(bs, -1)]
        inputs = topk_ids.reshape(-1)
        hid = hidden.repeat_interleave(k, dim=0)
        ancestors = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)
        for i in range(1, s.num_steps):  # topk > 1 (topk 1 is a chain: SpecSettings)
            pos = (seq_lens + i - 1).clamp(max=self.max_position)
            base = seq_lens[:, None] + (i - 1) * k
            batch = batches.make(ForwardMode.EXTEND, inputs, pos.repeat_interleave(k), slots,
                                 seq_lens, torch.full_like(seq_lens, k), seq_lens + i * k,
                                 batches.locs(slots, base + torch.arange(k, device=dev)),
                                 ancestors)
            h_out, h_logits = self.forward(batch, hid)
            p, ids = self.topk(h_logits)  # [bs * k, k]
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

    def _chain(self, batches: SpecBatches, slots, seq_lens, root, topk_ids, hidden) -> DraftTree:
        """A chain's levels: no scores to rank, each level's one draft follows the last."""
        drafts, inputs, hid = [topk_ids], topk_ids.reshape(-1), hidden
        for i in range(1, self.settings.num_steps):
            h_out, h_logits = self.forward(self._level(batches, inputs, slots, seq_lens, i), hid)
            ids = self.topk(h_logits)[1]
            drafts.append(ids)
            inputs, hid = ids.reshape(-1), h_out
        return chain_tree(root, drafts[0] if len(drafts) == 1 else torch.cat(drafts, dim=1))

    def _level(self, batches: SpecBatches, inputs, slots, seq_lens, i: int) -> ForwardBatch:
        """Level i of a one-child draft: each request's one node at position L + i - 1, its
        draft KV at index L + i - 1."""
        before = seq_lens + i - 1
        return batches.make(ForwardMode.DECODE, inputs, before.clamp(max=self.max_position),
                            slots, before, torch.ones_like(seq_lens), seq_lens + i,
                            batches.locs(slots, before[:, None]))
