"""Tensor parallelism: which part of the model each rank holds, and cutting the loaded weights
to it (Megatron's layout, as SGLang and vLLM run it).

    shard = TensorShard.join(tp=2, device)         # inside an initialised process group
    local_config = shard.shard_weights(loaded)     # loaded: gpu/loader/load.py's LoadedModel
    model = LlamaModel(local_config, loaded.weights, ...); shard.parallelize(model)

- column-parallel, no communication: qkv_proj (a rank's query heads and the KV heads they
  read, with their biases and q/k norms) and gate_up_proj (its slice of gate and of up);
- row-parallel, one all-reduce each: o_proj (over its heads' outputs) and down_proj (over its
  intermediate slice), so two all-reduces of [tokens, hidden] a layer;
- vocabulary-parallel: the embedding (a rank's rows; other ids give zeros, all-reduced) and
  the lm_head (a rank's rows of the vocabulary, the logits all-gathered), so every rank
  samples from the same full logits and draws the same tokens.

KV heads are split when tp divides their number; otherwise each rank keeps a copy of the KV
heads its query heads read (replicated), as one KV head per query head where the grouping
does not come out even. Int4 weights are cut as they are (gpu/int4_split.py); a row-parallel
one whose cut would split a quantization group is dequantized (that projection only).
The local ModelConfig says a rank's heads and intermediate size; vocab_size stays the model's.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu.int4_split import input_columns, output_rows
from gpu.loader.gguf_q4 import Int4Weight
from gpu.model_config import ModelConfig
from gpu.parallel_layers import RowParallel, VocabParallelEmbedding, VocabParallelHead
from gpu.sync_guard import expected_sync


def even_part(size: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `parts` near-equal parts of range(size)."""
    return size * index // parts, size * (index + 1) // parts


@dataclass(frozen=True)
class HeadSplit:
    q_heads: range  # the model's query heads this rank holds
    kv_heads: tuple[int, ...]  # the model's KV heads it keeps, in its own order


def split_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadSplit:
    if num_heads % tp:
        fits = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
        raise ValueError(f"parallel.tp = {tp} must divide the model's {num_heads} attention "
                         f"heads (each rank holds whole heads); tp can be one of "
                         f"{', '.join(map(str, fits))}")
    local = num_heads // tp
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    q_heads = range(rank * local, (rank + 1) * local)
    read = [h // group for h in q_heads]
    kept = sorted(set(read))
    if local % len(kept) == 0 and read == [k for k in kept for _ in range(local // len(kept))]:
        return HeadSplit(q_heads, tuple(kept))  # an even local grouping (split or replicated)
    return HeadSplit(q_heads, tuple(read))  # uneven: one KV head per query head


@dataclass
class TensorShard:
    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default group
    heads: HeadSplit | None = None  # set by shard_weights
    vocab_rows: int = 0  # every rank's share of the vocabulary (the last may hold fewer)

    @staticmethod
    def join(tp: int, device: torch.device) -> "TensorShard":
        """This process's shard of the initialised default group (gpu/tp_ranks.py starts it)."""
        if not dist.is_initialized() or dist.get_world_size() != tp:
            have = dist.get_world_size() if dist.is_initialized() else 1
            raise ValueError(f"parallel.tp = {tp} needs {tp} ranks in a torch.distributed group "
                             f"(this process has {have}): the service's worker process starts "
                             f"them (`fmserve serve --tp {tp}`); the offline engine runs in one "
                             f"process and takes parallel.tp = 1 only")
        return TensorShard(dist.get_rank(), tp)

    def shared_seed(self, device: torch.device) -> int:
        """A random seed drawn by rank 0 and the same on every rank: unseeded requests then draw
        the same seeds everywhere, so all ranks sample the same tokens."""
        seed = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], device=device)
        dist.broadcast(seed, 0, group=self.group)
        return int(seed.item())

    def check_same_tokens(self, tokens: torch.Tensor) -> None:
        """Debug (the WRWR check's companion): every rank sampled (or drafted) the same tokens,
        so their FutureMaps stay identical. One all-gather of the tokens."""
        parts = [torch.empty_like(tokens) for _ in range(self.size)]
        dist.all_gather(parts, tokens.contiguous(), group=self.group)
        same = (torch.stack(parts) == tokens).all()
        if tokens.device.type != "cpu":
            torch._assert_async(same, "tensor-parallel ranks chose different tokens")
            return
        with expected_sync():
            if not bool(same):
                raise RuntimeError(f"tensor-parallel ranks chose different tokens: "
                                   f"{[p.tolist() for p in parts]}")

    # -- cutting the weights -------------------------------------------------------------------

    def shard_weights(self, loaded) -> ModelConfig:
        """Cut a LoadedModel's weights (and int4 weights) to this rank, in place; returns the
        rank's ModelConfig."""
        cfg: ModelConfig = loaded.config
        heads = self.heads = split_heads(cfg.num_heads, cfg.num_kv_heads, self.size, self.rank)
        hd, inter = cfg.head_dim, cfg.intermediate_size
        q_rows = _head_rows(heads.q_heads, hd, 0)
        k_rows = _head_rows(heads.kv_heads, hd, cfg.q_size)
        qkv_rows = torch.cat([q_rows, k_rows, k_rows + cfg.kv_size])
        i0, i1 = even_part(inter, self.size, self.rank)
        gate_up_rows = torch.cat([torch.arange(i0, i1), torch.arange(inter + i0, inter + i1)])
        norm_rows = torch.tensor([*heads.q_heads, *(cfg.num_heads + k for k in heads.kv_heads)])
        self.vocab_rows = -(-cfg.vocab_size // self.size)
        v0 = self.rank * self.vocab_rows
        vocab = torch.arange(v0, min(cfg.vocab_size, v0 + self.vocab_rows))
        w, q4 = loaded.weights, loaded.q4
        dtype = w["embed_tokens"].dtype
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            keep_rows(w, q4, p + "qkv_proj", qkv_rows)
            keep_rows(w, q4, p + "gate_up_proj", gate_up_rows)
            keep_columns(w, q4, p + "o_proj", heads.q_heads.start * hd, heads.q_heads.stop * hd,
                         dtype)
            keep_columns(w, q4, p + "down_proj", i0, i1, dtype)
            if p + "qkv_bias" in w:
                w[p + "qkv_bias"] = w[p + "qkv_bias"][qkv_rows].contiguous()
            if p + "qk_norm" in w:
                w[p + "qk_norm"] = w[p + "qk_norm"][norm_rows].contiguous()
        w["embed_tokens"] = w["embed_tokens"][vocab].contiguous()
        if "lm_head" in w:
            w["lm_head"] = w["lm_head"][vocab].contiguous()
        if loaded.lm_head_q4 is not None:
            loaded.lm_head_q4 = output_rows(loaded.lm_head_q4, vocab)
        return dataclasses.replace(cfg, num_heads=len(heads.q_heads),
                                   num_kv_heads=len(heads.kv_heads), intermediate_size=i1 - i0)

    def parallelize(self, model) -> None:
        """Wrap a LlamaModel built on this rank's weights with the communication it needs."""
        for layer in model.layers:
            layer.o_proj = RowParallel(layer.o_proj, self.group)
            layer.down_proj = RowParallel(layer.down_proj, self.group)
        start = self.rank * self.vocab_rows
        model.embed = VocabParallelEmbedding(model.embed_tokens, start, self.group)
        model.lm_head = VocabParallelHead(model.lm_head, model.config.vocab_size,
                                          self.vocab_rows, self.size, self.group)


def _head_rows(heads, head_dim: int, offset: int) -> torch.Tensor:
    """The projection rows of `heads` (whole heads of head_dim rows), from row `offset`."""
    return torch.tensor([offset + h * head_dim + j for h in heads for j in range(head_dim)],
                        dtype=torch.int64)


def keep_rows(weights: dict, q4: dict, name: str, rows: torch.Tensor) -> None:
    """A column-parallel projection: keep output rows `rows`, dense or int4 segments alike."""
    if name in weights:
        weights[name] = weights[name][rows].contiguous()
        return
    kept, start = [], 0
    for segment in q4[name]:  # row segments in order; `rows` is increasing
        out = segment.shape.out_features
        mine = rows[(rows >= start) & (rows < start + out)] - start
        if mine.numel():
            kept.append(output_rows(segment, mine))
        start += out
    q4[name] = kept


def keep_columns(weights: dict, q4: dict, name: str, start: int, stop: int,
             dtype: torch.dtype) -> None:
    """A row-parallel projection: keep inputs [start, stop). An int4 weight whose cut would
    split a quantization group is dequantized first (this projection only)."""
    if name in q4:
        parts = [input_columns(s, start, stop) for s in q4[name]]
        if all(p is not None for p in parts):
            q4[name] = parts
            return
        segments: list[Int4Weight] = q4.pop(name)
        weights[name] = torch.cat([s.dequantize() for s in segments]).to(dtype)
    weights[name] = weights[name][:, start:stop].contiguous()
