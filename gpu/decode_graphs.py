"""CUDA graphs of the decoder for decode batches: one graph launch instead of ~600 kernels.

A decode step of a small model on a GPU is host-bound: the H100 profile in docs/benchmarks.md
spent 394 ms of host time against 43 ms of device time over 17 steps, about 790 launches a
step. Overlap cannot hide a host that is the bottleneck; replaying a captured graph removes
the per-kernel launches of the decoder (embedding, every layer, the final norm), as SGLang,
vLLM, mini-sglang and nano-vllm do. Logits and sampling stay eager (they differ per request).

How it works:
- one set of static input buffers, sized for the largest captured batch; each graph reads the
  first ``size`` rows of them and writes its hidden states into the first ``size`` rows of one
  static output buffer;
- a graph per bucket size (1, 2, 4, 8, then steps of 16 up to ``max_batch``), captured largest
  first into one shared memory pool;
- a decode batch of ``bs`` requests runs the smallest bucket >= bs: its rows are copied into
  the static buffers and the rows ``bs..size`` are padding: request slot 0 (reserved, its
  ``req_to_token`` row is all zeros), position 0, length 1, KV location 0 (in the pool's
  padding page 0). Padding rows attend to and overwrite only that padding location.

Only attention backends that read nothing from the host can be captured (``needs_cpu_seq_lens``
False: the Triton backend); the torch backend slices by host lengths. On the CPU there is no
graph: ``EagerReplay`` runs the same function again over the same static buffers, so the
bucketing, padding and copying above are tested on the CPU exactly as a GPU runs them; the
capture itself is exercised by tests/gpu/test_cuda.py on a GPU.
"""

from __future__ import annotations

import bisect
from functools import partial
from typing import Callable

import torch

from gpu.forward_batch import ForwardBatch, ForwardMode

# Rows of the static integer buffer, in order.
_FIELDS = ("input_ids", "positions", "slots", "seq_lens", "prefix_lens", "out_cache_loc")
# The value each field takes in a padding row (see the module docstring).
_PAD = {"input_ids": 0, "positions": 0, "slots": 0, "seq_lens": 1, "prefix_lens": 0,
        "out_cache_loc": 0}


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to ``max_batch`` (included)."""
    if max_batch < 1:
        raise ValueError(f"decode graphs need a largest batch of at least 1 (got {max_batch})")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class EagerReplay:
    """The CPU's stand-in for a captured graph: replaying runs the function again. It reads
    the same static buffers a CUDA graph would, so everything around the graph is the same."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def capture_buckets(sizes: list[int], device: torch.device,
                    make_fn: Callable[[int], Callable[[], None]]) -> dict[int, object]:
    """A graph of `make_fn(size)()` per bucket size, captured largest first into one memory
    pool (each warmed up twice on a side stream first: Triton compiles, the allocator
    settles); on the CPU, EagerReplay of the same function. Shared by the decode graphs and
    the EAGLE step's (gpu/eagle/eagle_graphs.py)."""
    cuda = device.type == "cuda"
    graphs: dict[int, object] = {}
    pool = None
    if cuda:
        torch.cuda.synchronize(device)
    for size in reversed(sizes):
        fn = make_fn(size)
        if not cuda:
            graphs[size] = EagerReplay(fn)
            continue
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        pool = graph.pool()
        graphs[size] = graph
    if cuda:
        torch.cuda.synchronize(device)
    return graphs


class DecodeGraphs:
    """Captured decoder forwards for decode batches of up to ``max_batch`` requests."""

    def __init__(self, model, attn, max_batch: int) -> None:
        if getattr(attn, "needs_cpu_seq_lens", True):
            raise ValueError(
                f"decode graphs need an attention backend that reads no host lengths; "
                f"{type(attn).__name__} does (use runtime.attention_backend = \"triton\", or "
                f"set runtime.cuda_graph_max_batch = 0)")
        self.model, self.attn = model, attn
        self.device = device = model.device
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.ints = torch.zeros(len(_FIELDS), self.max_batch, dtype=torch.int64, device=device)
        self.pad = torch.tensor([[_PAD[f]] * self.max_batch for f in _FIELDS],
                                dtype=torch.int64, device=device)
        self.ints.copy_(self.pad)
        self.ones = torch.ones(self.max_batch, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(self.max_batch, model.config.hidden_size, dtype=model.dtype,
                                  device=device)
        self.graphs: dict[int, object] = {}
        self.replays = 0  # decode steps that ran a graph (tests and benchmarks read it)

    def static_batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch a graph of ``size`` rows was captured with: views of the buffers."""
        rows = dict(zip(_FIELDS, self.ints[:, :size]))
        return ForwardBatch(mode=ForwardMode.DECODE, extend_lens=self.ones[:size], **rows)

    def _forward(self, batch: ForwardBatch) -> None:
        size = batch.batch_size
        self.attn.init_forward_metadata(batch)
        hidden, _ = self.model.hidden_states(batch, self.attn)
        self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. On the CPU: EagerReplay."""
        self.graphs = capture_buckets(
            self.sizes, self.device, lambda size: partial(self._forward, self.static_batch(size)))
        self.ints.copy_(self.pad)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode == ForwardMode.DECODE and 0 < batch.batch_size <= self.max_batch
                and bool(self.graphs))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder over a decode batch by graph replay: final hidden states [bs, H]. The
        result is a view of the static output buffer, valid until the next replay (the same
        stream orders every later reader before it)."""
        bs = batch.batch_size
        size = self.sizes[bisect.bisect_left(self.sizes, bs)]
        live = torch.stack([getattr(batch, f) for f in _FIELDS])
        self.ints[:, :bs].copy_(live)
        if size > bs:  # the previous replay may have left live rows there
            self.ints[:, bs:size].copy_(self.pad[:, :size - bs])
        self.graphs[size].replay()
        self.replays += 1
        return self.hidden[:bs]
