"""The decoder compiled with torch.compile (inductor's C++ backend) for decode batches on the CPU.

A CPU decode step of a small model spends more time dispatching ops one by one from Python
(norms, rope, activations, residual adds, attention bookkeeping: ~9 of 15 ms a token for the
default model) than in its matmuls. Inductor fuses the pointwise ops into C++ loops and calls
the matmuls (MKL, oneDNN, the int4 kernel of gpu/q4_linear.py) as extern kernels, so a step is
one call of generated code.

How it works:
- the compiled function is the model's own `hidden_states` over a decode batch, with the torch
  attention backend's decode attention (the KV write included) traced into the same graph;
  its inputs are the batch's tensors and the attention's per-forward metadata (key locations,
  the additive mask), so nothing it reads changes identity between steps (no recompiles);
- batch sizes are bucketed like the CUDA graphs' (gpu/decode_graphs.py): a batch of ``bs`` runs
  the smallest bucket >= bs with padding rows (slot 0, position 0, length 1, KV location 0 in
  the padding page), each bucket compiled with static shapes except the keys per request
  (marked dynamic: one graph per bucket serves every context length);
- compiling takes seconds per bucket (minutes cold on 2 cores for all of them), so only the
  buckets in ``eager_buckets`` ... see `CompiledDecode.warm_up`;
- inductor's on-disk caches (FX graph and AOT autograd) live under the fmserve cache dir
  (ipc/cache_dirs.py), so a second start skips inductor's code generation and C++ builds.

Prefill and mixed steps, EAGLE steps and batches above the largest bucket run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import os
import time

import torch

from gpu.attention.torch_backend import TorchAttentionBackend, _Group
from gpu.decode_graphs import bucket_sizes
from gpu.forward_batch import ForwardBatch, ForwardMode
from ipc.cache_dirs import compile_cache_dir

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")


def compile_applies(mode: str, device: torch.device, dtype: torch.dtype, attention_backend: str,
                    deterministic: bool) -> bool:
    """Whether plain decode steps run compiled. "auto": a CPU model in bf16 or fp32 with the
    torch attention backend (on CUDA, decode CUDA graphs are the tool). "on" where "auto"
    would not is refused, naming why."""
    if mode == "off":
        return False
    why_not = None
    if device.type != "cpu":
        why_not = (f"it compiles for the CPU only (the device is {device.type}; decode there "
                   f"uses runtime.cuda_graph_max_batch)")
    elif dtype not in (torch.bfloat16, torch.float32):
        why_not = f"it compiles bf16 and fp32 models only (the model is {dtype})"
    elif attention_backend != "torch":
        why_not = f"it traces the torch attention backend (the backend is {attention_backend})"
    elif deterministic:
        why_not = "runtime.deterministic's row-at-a-time forwards run eagerly"
    if why_not and mode == "on":
        raise ValueError(f"runtime.compile = \"on\" cannot apply: {why_not}; set it to "
                         f"\"auto\" or \"off\"")
    return why_not is None


class _DecodeAttention:
    """The torch backend's decode attention with its metadata given as traced tensors (the
    backend keeps per-forward metadata in attributes, which a compiled graph cannot read)."""

    def __init__(self, backend: TorchAttentionBackend, key_locs: torch.Tensor,
                 bias: torch.Tensor) -> None:
        self.backend = backend
        size, max_len = bias.shape[0], bias.shape[2]
        self.group = _Group(size, max_len, key_locs, torch.isfinite(bias)[:, :, None, :],
                            decode_bias=bias)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        self.backend.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        return self.backend._attend(q, layer_id, self.group)


class CompiledDecode:
    """The decoder compiled per bucket of decode batch sizes up to ``max_batch``."""

    def __init__(self, model, attn: TorchAttentionBackend, max_batch: int) -> None:
        if not isinstance(attn, TorchAttentionBackend):
            raise ValueError(f"the compiled decode step traces the torch attention backend "
                             f"(got {type(attn).__name__})")
        self.model, self.attn = model, attn
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        # One compiled function: dynamo keeps a graph per bucket (its static shapes are guards).
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    2 * len(self.sizes))
        self._compiled = torch.compile(self._forward, backend="inductor", dynamic=False,
                                       fullgraph=True)
        self.compiled_sizes: set[int] = set()
        self.runs = 0  # decode steps that ran compiled (tests and benchmarks read it)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 out_cache_loc: torch.Tensor, key_locs: torch.Tensor,
                 bias: torch.Tensor) -> torch.Tensor:
        ones = torch.ones_like(slots)
        batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=input_ids, positions=positions,
                             slots=slots, seq_lens=positions + 1, prefix_lens=positions,
                             extend_lens=ones, out_cache_loc=out_cache_loc)
        hidden, _ = self.model.hidden_states(batch, _DecodeAttention(self.attn, key_locs, bias))
        return hidden

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and 0 < batch.batch_size <= self.max_batch

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder over a decode batch, compiled: final hidden states [bs, H]."""
        bs = batch.batch_size
        size = self.sizes[bisect.bisect_left(self.sizes, bs)]
        ids, positions, slots, locs = (batch.input_ids, batch.positions, batch.slots,
                                       batch.out_cache_loc)
        if size > bs:  # padding rows: slot 0, position 0 (length 1), KV location 0
            pad = torch.zeros(size - bs, dtype=ids.dtype, device=ids.device)
            ids, positions, slots, locs = (torch.cat([t, pad]) for t in
                                           (ids, positions, slots, locs))
        group = self.attn._decode_group(slots, positions + 1, batch.max_seq_len)
        key_locs, bias = group.key_locs, group.decode_bias
        # Keys per request vary every step: dynamic, so one graph serves every length.
        torch._dynamo.mark_dynamic(key_locs, 0)
        torch._dynamo.mark_dynamic(bias, 2)
        hidden = self._compiled(ids, positions, slots, locs, key_locs, bias)
        self.compiled_sizes.add(size)
        self.runs += 1
        return hidden[:bs]
