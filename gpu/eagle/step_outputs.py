"""What an EAGLE step emits, from device tensors to the StepResult's buffers.

A step has parts (its prefill rows, its verify rows or its plain decode rows); each part's
outputs are copied to the host while the next step is planned, then unpacked row by row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gpu.eagle.tree import DraftTree, drafted_before
from ipc.worker_messages import pack_f32, pack_i32


@dataclasses.dataclass
class StepPart:
    """One part of a step (prefill rows, verify rows or plain decode rows): its slots on the
    host and what it emits as device tensors, copied to the host while the next step is
    planned. `outputs`: "tokens" [rows] (one token per row) or [rows, E] (verify rows, with
    "accept" [rows]); when some row asked for logprobs, per candidate token "logprobs" and
    the top n "top_ids" / "top_logprobs" [candidates, n]."""

    slots: np.ndarray
    outputs: dict[str, torch.Tensor]
    verify: bool = False


@dataclasses.dataclass
class PartRows:
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
    def of(cls, part: StepPart, host: dict[str, np.ndarray]) -> "PartRows":
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


def logprob_outputs(out) -> dict[str, torch.Tensor]:
    """A SampleOutput's logprob tensors, by their StepPart.outputs names (none if not asked)."""
    if out is None or out.logprobs is None:
        return {}
    found = {"logprobs": out.logprobs.float()}
    if out.top_logprob_ids is not None and out.top_logprob_ids.shape[-1]:
        found["top_ids"] = out.top_logprob_ids
        found["top_logprobs"] = out.top_logprobs.float()
    return found


def merge_logprobs(parts: list[PartRows]) -> tuple[bytes, int, bytes, bytes]:
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


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [bs, w] padded with -1 (or cut) to [bs, width]."""
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def outputs_of(parts: list[StepPart]) -> dict[str, torch.Tensor]:
    """Every part's device outputs under one flat naming, for one host copy."""
    return {f"{i}/{name}": t for i, p in enumerate(parts) for name, t in p.outputs.items()}


def rows_of(parts: list[StepPart], host: dict[str, torch.Tensor]) -> list[PartRows]:
    """Each part's rows, from the flat host copy `outputs_of` named."""
    rows = []
    for i, part in enumerate(parts):
        prefix = f"{i}/"
        mine = {k[len(prefix):]: v.numpy() for k, v in host.items() if k.startswith(prefix)}
        rows.append(PartRows.of(part, mine))
    return rows


def verify_logprobs(sampler, tree: DraftTree, logits: torch.Tensor, path: torch.Tensor,
                    out_tokens: torch.Tensor, slots: torch.Tensor, slots_host: np.ndarray):
    """Logprobs of a verify's emitted tokens [bs, E], each from the logits of the node it
    follows (the root, then the accepted drafts on `path`), as the plain step reports them."""
    bs, T, E = tree.tokens.shape[0], tree.tokens.shape[1], out_tokens.shape[1]
    node_rows = (torch.arange(bs, device=logits.device)[:, None] * T + path).reshape(-1)
    return sampler.logprobs_of(logits[node_rows], slots.repeat_interleave(E),
                               out_tokens.clamp(min=0).reshape(-1),
                               slots_host=np.repeat(slots_host, E),
                               drafted=drafted_before(tree).rows(node_rows))
