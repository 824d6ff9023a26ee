"""EAGLE-3 training-time test (TTT): the head unrolled on its own outputs, as it drafts.

Alignment (the same as serving, see gpu/eagle/spec_worker.py): at step 0, row ``i`` reads the
target's aux hidden state at position ``i`` and the embedding of token ``i + 1``, sits at position
``i`` and predicts token ``i + 2`` (the target's next-token distribution at position ``i + 1``).
At step ``k`` the same row reads its own step ``k - 1`` output hidden state and token
``i + 1 + k``, sits at position ``i + k`` and predicts token ``i + 2 + k``: row ``i`` is one draft
chain rooted at ``i``, teacher-forced on the true tokens.

Attention at step ``k`` sees the step-0 keys of positions ``0..i`` (causal) plus the keys the
same row made at steps ``1..k`` (SpecForge's per-step key cache, "cache_hidden"). That is exactly
what a chain rooted at ``i`` sees when serving: the draft extend's keys up to the root, then its
own draft keys. Steps >= 1 run only on the rows that carry a loss (roots in the response).

Loss per step: soft cross-entropy between the head's draft-vocabulary logits and the target's
distribution restricted to the draft vocabulary (renormalised), averaged over the valid rows,
weighted by ``decay ** k``. Accuracy per step: the head's argmax, mapped to a target id, equals
the target's argmax over the full vocabulary (so a target argmax outside the draft vocabulary
always counts as a miss; it still trains through the soft loss).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fmserve.train_eagle.shards import CapturedData


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, 0-padded
    aux_hidden: torch.Tensor  # [B, L, k*H] float32
    final_hidden: torch.Tensor  # [B, L, H] float32
    target_argmax: torch.Tensor  # [B, L] int64, -1 padded
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(data: CapturedData, seqs: list[int], device: torch.device | str | None = None
            ) -> Batch:
    """A padded batch of sequences ``seqs``, assembled on the CPU. ``device`` a GPU: assembled
    in pinned memory and copied there without blocking (the copies queue before the forward on
    the same stream). ``lengths`` and ``prompt_lens`` stay on the CPU (small; read on the host)."""
    device = torch.device(device) if device is not None else None
    pin = device is not None and device.type == "cuda"
    B, L = len(seqs), max(data.length(j) for j in seqs)
    aux_w = data.rows(seqs[0], "aux_hidden").shape[1]
    h = data.rows(seqs[0], "final_hidden").shape[1]
    ids = torch.zeros(B, L, dtype=torch.int64, pin_memory=pin)
    aux = torch.zeros(B, L, aux_w, pin_memory=pin)
    final = torch.zeros(B, L, h, pin_memory=pin)
    argmax = torch.full((B, L), -1, dtype=torch.int64, pin_memory=pin)
    for b, j in enumerate(seqs):
        n = data.length(j)
        ids[b, :n] = data.rows(j, "input_ids")
        aux[b, :n] = data.rows(j, "aux_hidden")
        final[b, :n] = data.rows(j, "final_hidden")
        argmax[b, :n] = data.rows(j, "target_argmax")
    if device is not None and device.type != "cpu":
        ids, aux, final, argmax = (t.to(device, non_blocking=pin)
                                   for t in (ids, aux, final, argmax))
    return Batch(ids, aux, final, argmax,
                 torch.tensor([data.length(j) for j in seqs]),
                 torch.tensor([data.prompt_len[j] for j in seqs]))


class _StepAttention:
    """The attention callables for one TTT unroll over a [B, L] grid (rows flattened)."""

    def __init__(self, B: int, L: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rows: torch.Tensor, row_pos: torch.Tensor) -> None:
        self.B, self.L = B, L
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim
        self.g = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5
        self.rows, self.row_pos = rows, row_pos  # the loss rows (flat grid index, position)
        self.k0 = self.v0 = None  # step 0 keys / values [B, nkv, L, hd]
        self.diag_k: list[torch.Tensor] = []  # per step >= 1: [nR, nkv, hd]
        self.diag_v: list[torch.Tensor] = []

    def step0(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, L = self.B, self.L
        q = q.view(B, L, self.nh, self.hd).transpose(1, 2)
        self.k0 = k.view(B, L, self.nkv, self.hd).transpose(1, 2)
        self.v0 = v.view(B, L, self.nkv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, self.k0, self.v0, is_causal=True, scale=self.scale,
                                           enable_gqa=self.g > 1)
        return o.transpose(1, 2).reshape(B * L, self.nh, self.hd)

    def later(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A step >= 1 over the loss rows: step-0 keys up to the root, then the row's own."""
        B, L, nkv, g, hd = self.B, self.L, self.nkv, self.g, self.hd
        n, nR = B * L, q.shape[0]
        self.diag_k.append(k)
        self.diag_v.append(v)
        # Scores against the step-0 keys, on the grid (cheap next to the head's linears).
        q_grid = q.new_zeros(n, self.nh, hd).index_copy(0, self.rows, q)
        q_grid = q_grid.view(B, L, nkv, g, hd).permute(0, 2, 3, 1, 4)  # [B, nkv, g, L, hd]
        s0 = torch.matmul(q_grid, self.k0.unsqueeze(2).transpose(-1, -2))  # [B, nkv, g, L, L]
        s0 = s0.permute(0, 3, 1, 2, 4).reshape(n, nkv, g, L)[self.rows] * self.scale
        future = torch.arange(L, device=q.device)[None, :] > self.row_pos[:, None]  # [nR, L]
        s0 = s0.masked_fill(future[:, None, None, :], float("-inf"))
        qr = q.view(nR, nkv, g, hd)
        sd = torch.stack([(qr * dk[:, :, None, :]).sum(-1) for dk in self.diag_k], dim=-1)
        p = torch.softmax(torch.cat([s0, sd * self.scale], dim=-1), dim=-1)
        p0, pd = p[..., :L], p[..., L:]
        p_grid = p0.new_zeros(n, nkv, g, L).index_copy(0, self.rows, p0)
        p_grid = p_grid.view(B, L, nkv, g, L).permute(0, 2, 3, 1, 4)  # [B, nkv, g, Lq, Lk]
        o0 = torch.matmul(p_grid, self.v0.unsqueeze(2))  # [B, nkv, g, L, hd]
        o = o0.permute(0, 3, 1, 2, 4).reshape(n, nkv, g, hd)[self.rows]
        for s, dv in enumerate(self.diag_v):
            o = o + pd[..., s:s + 1] * dv[:, :, None, :]
        return o.reshape(nR, self.nh, hd)


@dataclass
class StepStats:
    losses: list[torch.Tensor]  # per TTT step (graph attached)
    correct: list[int]
    counts: list[int]
    loss: torch.Tensor  # the weighted sum to backpropagate
    # Per loss row (chain root) and step: was the step valid, was the draft right.
    row_valid: list[torch.Tensor]
    row_correct: list[torch.Tensor]
    rows: torch.Tensor | None = None  # flat grid index of each loss row (keep_logits)
    row_logits: list[torch.Tensor] | None = None  # per step: [rows, draft_vocab] (keep_logits)


def ttt_forward(head, batch: Batch, draft_embed: torch.Tensor, ttt_steps: int,
                decay: float = 0.8, keep_logits: bool = False,
                prompt_weight: float = 0.0) -> StepStats:
    """One TTT unroll over a batch. ``draft_embed`` [draft_vocab, H]: the target's lm_head rows
    of the draft vocabulary (the target's logits over it come from the stored final hidden).

    ``prompt_weight`` > 0 also trains chains rooted inside the prompt (the target's distribution
    there is as good a teacher; the text is not its own), their loss weighted by it. Accuracy
    and the per-row results only ever count chains rooted in the response."""
    cfg = head.config
    B, L = batch.input_ids.shape
    n = B * L
    dev = draft_embed.device
    pos = torch.arange(L, device=dev).repeat(B)  # [n]
    lens = batch.lengths.to(dev).repeat_interleave(L)
    plens = batch.prompt_lens.to(dev).repeat_interleave(L)
    # Loss rows: chain roots from the last prompt position on, predicting at least one token.
    first = plens - 1 if prompt_weight <= 0 else torch.zeros_like(plens)
    rows = torch.nonzero((pos >= first) & (pos <= lens - 3)).squeeze(1)
    row_pos, row_len = pos[rows], lens[rows]
    in_response = row_pos >= plens[rows] - 1
    row_weight = torch.where(in_response, 1.0, prompt_weight)
    # Target rows: positions whose next-token distribution some step predicts.
    tgt = torch.nonzero((pos >= first + 1) & (pos <= lens - 2)).squeeze(1)
    # The teacher's distribution in fp32 even under a caller's autocast (bf16 logits of ~20
    # would round by ~0.1 and blur it).
    no_autocast = torch.autocast(dev.type, enabled=False) if dev.type == "cuda" else nullcontext()
    with torch.no_grad(), no_autocast:
        final = batch.final_hidden.to(dev).reshape(n, -1)[tgt]
        target_p = torch.softmax(F.linear(final, draft_embed).float(), dim=-1)
        tmap = torch.full((n,), -1, dtype=torch.long, device=dev)
        tmap[tgt] = torch.arange(tgt.shape[0], device=dev)
    argmax = batch.target_argmax.to(dev).reshape(n)
    ids_pad = F.pad(batch.input_ids.to(dev), (0, ttt_steps + 1))  # token i+1+k for any k

    attn = _StepAttention(B, L, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rows, row_pos)
    losses, correct, counts, row_valid, row_correct = [], [], [], [], []
    total = None
    hidden = None
    kept: list[torch.Tensor] = []
    for k in range(ttt_steps):
        tok = ids_pad[:, 1 + k:1 + k + L].reshape(n)
        if k == 0:
            out, logits_hidden = head(tok, batch.aux_hidden.to(dev).reshape(n, -1), pos,
                                      attn.step0)
            out, logits_hidden = out[rows], logits_hidden[rows]
        else:
            out, logits_hidden = head(tok[rows], hidden, row_pos + k, attn.later)
        hidden = out
        if keep_logits:
            kept.append(head.logits(logits_hidden).detach())
        valid = row_pos + 1 + k <= row_len - 2
        target_index = torch.where(valid, rows + 1 + k, torch.zeros_like(rows))
        if not bool(valid.any()):
            break
        sel = torch.nonzero(valid).squeeze(1)
        logp = torch.log_softmax(head.logits(logits_hidden[sel]), dim=-1)
        tp = target_p[tmap[target_index[sel]]]
        w = row_weight[sel]
        loss_k = (-(tp * logp).sum(-1) * w).sum() / w.sum()
        losses.append(loss_k)
        total = loss_k * decay ** k if total is None else total + loss_k * decay ** k
        with torch.no_grad():
            pred = head.draft_to_target(logp.argmax(-1))
            resp = in_response[sel]
            hit = (pred == argmax[target_index[sel]]) & resp
            correct.append(int(hit.sum()))
            counts.append(int(resp.sum()))
            row_valid.append(valid & in_response)
            row_correct.append(torch.zeros_like(valid).index_put_((sel,), hit))
    if total is None:
        total = sum(p.sum() * 0.0 for p in head.parameters())
    return StepStats(losses, correct, counts, total, row_valid, row_correct,
                     rows if keep_logits else None, kept if keep_logits else None)


def expected_accept_length(acc: list[float]) -> float:
    """1 (the bonus token) + sum over k of the product of the first k step accuracies: the accept
    length of a chain whose step-k accuracy (given the earlier drafts right) is acc[k]."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total
