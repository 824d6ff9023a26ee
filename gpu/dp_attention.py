"""DP attention (`parallel.dp_attention = true` with `parallel.tp = N`; SGLang's
--enable-dp-attention): N ranks stepping in lockstep, the attention data-parallel and the MLP
tensor-parallel across the same ranks.

- Every rank holds the whole attention (qkv_proj, o_proj, all heads), its own requests, KV
  pool, slots and FutureMap; the embedding and the lm_head stay whole on every rank too (each
  rank embeds and samples its own tokens, with no collective), and so does an EAGLE head.
- The MLP is cut as gpu/tensor_parallel.py cuts it: gate_up column-parallel, down row-parallel.
  Per layer, every rank's normed hidden states are all-gathered (padded to the largest count),
  each rank runs its MLP slice on all the ranks' tokens, the partial outputs are all-reduced
  and each rank keeps its own rows.
- Token counts are exchanged once per forward (`begin_forward`, on the host: the counts size
  the padding), and once per EAGLE step which parts run (`agree_parts`), so every rank makes
  the same forwards, hence the same collectives. A rank with no tokens takes part all the
  same (an idle batch: zero rows in, zero rows out).

    dp = AttentionDataParallel.join(tp=2, device)
    local_config = dp.shard_weights(loaded); model = LlamaModel(local_config, ...)
    dp.parallelize(model)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpu.model_config import ModelConfig
from gpu.sync_guard import expected_sync
from gpu.tensor_parallel import even_part, keep_columns, keep_rows


class AttentionDataParallel:
    def __init__(self, rank: int, size: int, host_group: dist.ProcessGroup | None) -> None:
        self.rank, self.size = rank, size
        self.host_group = host_group  # gloo for the host's counts (None: the default group)
        self.counts: list[int] = [0] * size  # this forward's tokens on each rank
        self.offset = 0  # this rank's first row among all the ranks' tokens
        self.forwards = 0

    @staticmethod
    def join(tp: int, device: torch.device) -> "AttentionDataParallel":
        """This process's place in the initialised default group (gpu/tp_ranks.py starts it)."""
        if not dist.is_initialized() or dist.get_world_size() != tp:
            have = dist.get_world_size() if dist.is_initialized() else 1
            raise ValueError(f"parallel.dp_attention with parallel.tp = {tp} needs {tp} ranks "
                             f"in a torch.distributed group (this process has {have}); the "
                             f"offline engine runs one process and cannot run it")
        # Counts live on the host; over NCCL they take a gloo group of the same ranks.
        host = dist.new_group(backend="gloo") if device.type == "cuda" else None
        return AttentionDataParallel(dist.get_rank(), tp, host)

    def shard_weights(self, loaded) -> ModelConfig:
        """Cut a LoadedModel's MLP weights to this rank, in place (attention, embedding and
        lm_head stay whole); returns the rank's ModelConfig."""
        cfg: ModelConfig = loaded.config
        inter = cfg.intermediate_size
        i0, i1 = even_part(inter, self.size, self.rank)
        gate_up_rows = torch.cat([torch.arange(i0, i1), torch.arange(inter + i0, inter + i1)])
        w, q4 = loaded.weights, loaded.q4
        for i in range(cfg.num_layers):
            keep_rows(w, q4, f"layers.{i}.gate_up_proj", gate_up_rows)
            keep_columns(w, q4, f"layers.{i}.down_proj", i0, i1, w["embed_tokens"].dtype)
        return dataclasses.replace(cfg, intermediate_size=i1 - i0)

    def parallelize(self, model) -> None:
        """Wrap a LlamaModel built on this rank's weights with the MLP's communication."""
        model.dp_attention = self
        for layer in model.layers:
            layer.gate_up_proj = GatherTokens(layer.gate_up_proj, self)
            layer.down_proj = ReduceOwnRows(layer.down_proj, self)

    # -- per step and per forward, on the host ----------------------------------------------

    def _all_gather_host(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.host_group)
        with expected_sync():  # host tensors: nothing waits for a device
            return [p.tolist() for p in parts]

    def begin_forward(self, num_tokens: int) -> None:
        """Every rank's token count for the forward about to run (LlamaModel.hidden_states)."""
        self.counts = [c for (c,) in self._all_gather_host([num_tokens])]
        self.offset = sum(self.counts[:self.rank])
        self.forwards += 1

    def agree_parts(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over the ranks: an EAGLE step runs its prefill part where any rank
        prefills, so every rank makes the same target forwards."""
        every = self._all_gather_host([int(f) for f in flags])
        return tuple(any(rank[i] for rank in every) for i in range(len(flags)))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[own tokens, hidden] -> [all the ranks' tokens, hidden], rank by rank."""
        widest = max(self.counts)
        if widest == 0:  # every rank idle: the same on all, so all skip
            return x
        padded = F.pad(x, (0, 0, 0, widest - x.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:c] for p, c in zip(parts, self.counts)])

    def reduce_own_rows(self, y: torch.Tensor) -> torch.Tensor:
        """Partial sums over all the ranks' tokens -> the full sums of this rank's rows.
        An all-reduce, then a slice, rather than a reduce-scatter: gloo has no reduce-scatter,
        and the ranks' rows differ in number (a reduce-scatter would need them padded)."""
        if max(self.counts) == 0:
            return y
        y = y.contiguous()
        dist.all_reduce(y)
        return y[self.offset:self.offset + self.counts[self.rank]]


class GatherTokens:
    """gate_up_proj's slice, run on every rank's tokens."""

    def __init__(self, inner, dp: AttentionDataParallel) -> None:
        self.inner, self.dp = inner, dp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.dp.gather(x))


class ReduceOwnRows:
    """down_proj's slice: its partial sums over every rank's tokens, reduced, own rows kept."""

    def __init__(self, inner, dp: AttentionDataParallel) -> None:
        self.inner, self.dp = inner, dp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.dp.reduce_own_rows(self.inner(x))
