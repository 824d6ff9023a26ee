"""The draft head being trained: built fresh with the responses' draft vocabulary, or started
from a trained head; the target pieces it is built from; written in its shipping form."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def load_target(model_path: Path):
    """The target's config, embedding (= lm_head, tied) and final norm, fp32."""
    from gpu.loader.load import load_model

    loaded = load_model(model_path, dtype=torch.float32, progress=False)
    w = loaded.weights
    if not loaded.config.tie_word_embeddings and "lm_head" in w:
        lm_head = w["lm_head"]
    else:
        lm_head = w["embed_tokens"]
    return loaded.config, w["embed_tokens"], lm_head, w["final_norm"]


def build_head(model_cfg, embed: torch.Tensor, final_norm: torch.Tensor,
               token_counts: torch.Tensor, draft_vocab_size: int, seed: int,
               init_lm_head_from_target: bool = False, intermediate_size: int = 0):
    """A fresh head (HF-style random init, as SpecForge starts) with the draft vocabulary of the
    most frequent response tokens. ``init_lm_head_from_target`` starts lm_head and the final
    norm from the target's instead: measured worse here (the random first steps make the
    borrowed logits wildly overconfident, loss ~70 against ~27 from random)."""
    from gpu.eagle.head_io import random_draft_head
    from gpu.eagle.vocab_map import build_vocab_map

    dv = min(draft_vocab_size, model_cfg.vocab_size)
    head = random_draft_head(model_cfg, embed, None, algorithm="eagle3", draft_vocab_size=dv,
                             seed=seed, dtype=torch.float32,
                             intermediate_size=intermediate_size or None)
    d2t, t2d = build_vocab_map(token_counts, dv)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        if init_lm_head_from_target:
            head.lm_head.weight.copy_(embed[torch.arange(dv) + d2t])
            head.norm.weight.copy_(final_norm)
    return head


def vocab_counts_with_prior(response_counts: torch.Tensor, prior_file: str,
                            model_path: Path) -> torch.Tensor:
    """Response counts (weighted 10x) plus token counts of the prompts and references of a JSONL
    file: a steadier frequency estimate than a few hundred responses give (+1.5 points of
    held-out coverage at 8192 measured). Ties still go to the lower (more common BPE) id."""
    from service.tokenizer import TextTokenizer

    texts = []
    with open(Path(prior_file).expanduser(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if isinstance(row, dict):
                    texts += [str(row.get("prompt") or ""), str(row.get("reference") or "")]
    tok = TextTokenizer.from_model_path(model_path)
    vocab = response_counts.shape[0]
    prior = torch.zeros(vocab, dtype=torch.int64)
    for i in range(0, len(texts), 1024):
        for ids in (tok.encode(t) for t in texts[i:i + 1024] if t):
            if ids:
                prior += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
    scale = max(1, int(prior.sum()) // max(1, int(response_counts.sum())))
    return 10 * scale * response_counts + prior


def init_from_head(head, directory: str, model_cfg, embed: torch.Tensor,
                   refresh_vocab: bool = False) -> None:
    """Start ``head`` from a trained head's weights (fine-tuning it on more data). The two must
    have the same target, aux layers and width. Without ``refresh_vocab`` the trained head's
    draft vocabulary is kept (and its size must match); with it, ``head`` keeps the vocabulary
    it was built with (counted on this run's data) and only the lm_head rows change:
    ``remap_lm_head``."""
    from gpu.eagle.head_io import load_draft_head
    src = load_draft_head(directory, model_cfg, embed, None, "cpu", torch.float32)
    mine, theirs = head.config, src.config
    keys = ("hidden_size", "intermediate_size", "aux_layer_ids", "num_heads")
    if not refresh_vocab:
        keys += ("draft_vocab_size",)
    for key in keys:
        if getattr(mine, key) != getattr(theirs, key):
            raise SystemExit(f"train-eagle: --init-head {directory} has {key}="
                             f"{getattr(theirs, key)}, this run {getattr(mine, key)}: give "
                             f"matching settings (e.g. --draft-vocab-size) or start fresh")
    if not refresh_vocab:
        head.load_state_dict(src.state_dict(), strict=True)
        return
    state = {k: v for k, v in src.state_dict().items()
             if k not in ("lm_head.weight", "d2t", "t2d")}
    state["lm_head.weight"] = remap_lm_head(src, head, embed)
    state["d2t"], state["t2d"] = head.d2t.clone(), head.t2d.clone()
    head.load_state_dict(state, strict=True)


def remap_lm_head(src, head, embed: torch.Tensor) -> torch.Tensor:
    """lm_head rows for ``head``'s draft vocabulary from ``src``'s trained rows: a token in both
    vocabularies keeps its row; a new token gets the linear map from target embedding rows to
    trained rows (least squares over the shared tokens) applied to its embedding, so it starts
    on the trained rows' scale and geometry instead of at random."""
    def ids(h):
        return torch.arange(h.config.draft_vocab_size) + h.d2t.cpu()
    src_ids, new_ids = ids(src), ids(head)
    src_rows = src.lm_head.weight.detach().float().cpu()
    row_of = {int(t): i for i, t in enumerate(src_ids)}
    emb = embed.float().cpu()
    fit = torch.linalg.lstsq(emb[src_ids], src_rows).solution  # [H, H]
    out = emb[new_ids] @ fit
    kept = torch.tensor([int(t) in row_of for t in new_ids])
    out[kept] = src_rows[[row_of[int(t)] for t in new_ids[kept]]]
    return out


def draft_embed(head, embed: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows (tied: the embedding) of the draft vocabulary, on the head's
    device."""
    dv = head.config.draft_vocab_size
    rows = torch.arange(dv) + head.d2t.cpu()
    return embed[rows.to(embed.device)].contiguous().to(head.d2t.device)


def ship_head(head, out: Path, dtype: torch.dtype, record: dict) -> None:
    """Write the head (config.json + model.safetensors) file by file atomically, plus a record."""
    from gpu.eagle.head_io import save_draft_head

    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft_head(head, tmp, dtype=dtype)
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "training.json"):
        os.chmod(tmp / name, 0o644)
        os.replace(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)
