"""The reduced draft vocabulary of an EAGLE-3 head: d2t (draft id -> target id offset) and t2d
(target ids the head can propose), checked on load and built from token counts for training."""

from __future__ import annotations

import torch

from gpu.eagle.draft_head import DraftHeadConfig, DraftHeadError


def check_vocab_maps(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Fill in / check d2t and t2d (eagle3). t2d is rebuilt from d2t, the map decoding uses."""
    dv, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in tensors:
        if dv != vocab:
            raise DraftHeadError(f"{where}: the head has a reduced vocabulary (draft_vocab_size "
                                 f"{dv} < vocab_size {vocab}) but no 'd2t' tensor mapping draft "
                                 f"ids to target ids; the checkpoint is incomplete")
        tensors["d2t"] = torch.zeros(dv, dtype=torch.int64)
    d2t = tensors["d2t"]
    if d2t.dim() != 1 or d2t.shape[0] != dv:
        raise DraftHeadError(f"{where}: 'd2t' has shape {tuple(d2t.shape)}, but draft_vocab_size "
                             f"{dv} needs ({dv},); config.json and the weights disagree")
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise DraftHeadError(f"{where}: 'd2t' holds {d2t.dtype}; it must hold integer offsets")
    d2t = d2t.to(torch.int64)
    targets = torch.arange(dv) + d2t
    if dv and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise DraftHeadError(f"{where}: 'd2t' maps draft ids outside the target vocabulary "
                             f"(0..{vocab - 1}); the head was made for another tokenizer")
    if "t2d" in tensors and tuple(tensors["t2d"].shape) != (vocab,):
        raise DraftHeadError(f"{where}: 't2d' has shape {tuple(tensors['t2d'].shape)}, but "
                             f"vocab_size {vocab} needs ({vocab},)")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors["d2t"], tensors["t2d"] = d2t, t2d


def build_vocab_map(token_counts: torch.Tensor,
                    draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target ids (ties: lower id first), ascending.

    Returns d2t [draft_vocab] int64 (target_id = draft_id + d2t[draft_id]) and t2d [vocab] bool.
    """
    counts = token_counts.detach().flatten().to("cpu")
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise DraftHeadError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the "
                             f"length of token_counts)")
    order = torch.sort(counts, descending=True, stable=True).indices[:draft_vocab_size]
    kept = order.sort().values.to(torch.int64)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
