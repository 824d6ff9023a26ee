"""The decoder compiled with torch.compile (inductor's C++ backend) for decode batches on the CPU.

A CPU decode step of a small model spends more time dispatching ops one by one from Python
(norms, rope, activations, residual adds, attention bookkeeping) than in its matmuls. Inductor
fuses the pointwise ops into C++ loops and calls the matmuls (MKL, oneDNN, the int4 kernel of
gpu/q4_linear.py) as extern kernels, so the decoder is one call of generated code.

How it works:
- the compiled function is the decoder over a decode batch: the model's embedding, its own
  `layer_forward` for each layer with the torch attention backend's decode attention (the KV
  write included), its final norm; its inputs are the batch's tensors and the attention's
  metadata (key locations, one additive mask per distinct window of the layers: two for
  Gemma 3), so nothing it reads changes identity between steps;
- each layer is a call of one nested compile region (`torch.compiler.nested_compile_region`)
  whose inputs are the layer's KV buffers, RoPE tables and mask: dynamo traces it once (twice:
  the first layer has no MLP output to add; once more per extra window) and stamps the trace
  out for the other layers, and inductor compiles that one body. A cold compile of the
  default model takes half the time of the whole decoder's, a step the same time;
- batch sizes are bucketed like the CUDA graphs' (gpu/decode_graphs.py: 1, 2, 4, 8, 16, 32,
  48, 64): a batch of ``bs`` runs the smallest bucket >= bs with padding rows (slot 0,
  position 0, length 1, KV location 0 in the padding page). The keys per request are marked
  dynamic, so one graph serves every length, and above bucket 1 so is the batch size
  (`maybe_mark_dynamic`: static where the code specializes on it): the buckets above 1 share
  the graphs dynamo makes, one per branch on the row count (the 4-bit kernel's
  `q4_max_tokens`), so building bucket 8 after bucket 2 compiles nothing (the default model:
  2 real compiles for buckets 2-64 instead of 6; the steps as fast as static buckets');
- bucket 1 (one stream, where the per-op cost is largest) compiles at start-up: in the worker
  process on a thread while the worker already serves eagerly (gpu/background_compile.py;
  decode steps switch to it at a step boundary once it is built), in the offline Engine
  before it returns. Any other bucket compiles the first time a batch needs it: under
  runtime.compile = "auto" on a thread too (`background_buckets`: every decode step runs
  eagerly until it is built, one build at a time, as torch.compile is not thread-safe: no
  compiled step runs beside a compile), under "on" in that step, which waits. A
  bucket of the default model costs ~25-30 s cold on 2 cores and ~8 s warm, so compiling
  them all at start would hold the service back for minutes, and a cold one inside a step
  would hold every stream;
- inductor's on-disk caches (FX graph and AOT autograd) go under the fmserve cache dir
  (ipc/cache_dirs.py) unless TORCHINDUCTOR_CACHE_DIR names another directory than torch's
  default, so a restart compiles warm;
- bf16 is compiled with inductor's `emulate_precision_casts`: fused kernels round where eager
  rounds, so greedy tokens stay those of the eager step.

Prefill and mixed steps, EAGLE steps and batches above the largest bucket run eagerly.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
import types
from functools import partial
from typing import Iterator

import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.background_compile import BackgroundCompile
from gpu.decode_graphs import bucket_sizes
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import write_kv
from gpu.layers import apply_rope
from ipc.cache_dirs import compile_cache_dir

log = logging.getLogger(__name__)

# Above this many rows a step's matmuls dwarf the per-op overhead: larger batches run eagerly.
COMPILE_MAX_BATCH = 64
ENV_COMPILE = "FMSERVE_COMPILE"  # overrides runtime.compile = "auto" (the test suite: "off")


def compile_mode(configured: str) -> str:
    """runtime.compile, with $FMSERVE_COMPILE deciding what "auto" means when it is set."""
    env = os.environ.get(ENV_COMPILE, "").strip().lower()
    if configured == "auto" and env in ("auto", "on", "off"):
        return env
    return configured


def compile_applies(mode: str, device: torch.device, dtype: torch.dtype, attention_backend: str,
                    deterministic: bool, tp: int = 1, kernel_max_rows: int | None = None
                    ) -> bool:
    """Whether plain decode steps run compiled. "auto": a CPU model in bf16 or fp32 with the
    torch attention backend (on CUDA decode CUDA graphs are the tool). "on" where "auto" would
    not is refused, saying why."""
    if mode == "off":
        return False
    why_not = None
    if device.type != "cpu":
        why_not = (f"it compiles for the CPU only (the device is {device.type}; decode there "
                   f"replays CUDA graphs, runtime.cuda_graph_max_batch)")
    elif dtype not in (torch.bfloat16, torch.float32):
        why_not = f"it compiles bf16 and fp32 models only (the model is {dtype})"
    elif attention_backend != "torch":
        why_not = f"it traces the torch attention backend (the backend is {attention_backend})"
    elif deterministic:
        why_not = "runtime.deterministic's row-at-a-time forwards run eagerly"
    elif tp > 1:  # all-reduces inside the graph are not traced
        why_not = f"tensor-parallel ranks (parallel.tp = {tp}) run eagerly"
    elif kernel_max_rows == 0:  # C calls on raw pointers, FBGEMM's packed-weight objects
        why_not = ("one stream's projections take the wide path (scratch dequantization or "
                   "FBGEMM fp16 packs, a CPU without native bf16, gpu/cpu_kernels.py), which "
                   "torch.compile cannot trace; --dtype fp32 compiles")
    if why_not and mode == "on":
        raise ValueError(f"runtime.compile = \"on\" cannot apply: {why_not}; set it to "
                         f"\"auto\" or \"off\"")
    return why_not is None


def _use_fmserve_cache_dir() -> None:
    """Point inductor's caches at the fmserve cache dir unless TORCHINDUCTOR_CACHE_DIR names
    another: torch writes its own default into the variable the first time it looks (triton
    does too), so that default counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


@contextlib.contextmanager
def _without_function_modes() -> Iterator[None]:
    """Set aside the TorchFunctionModes (the sync check's): dynamo guards on the mode stack, so
    a graph compiled without them would be recompiled under them; the compiled graph itself
    is traced code that reads nothing to the host."""
    popped = []
    while torch._C._len_torch_function_stack():
        popped.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


_SELF_GUARDS = ("self", "type(self", "dict(type(self")  # how dynamo names their sources


def _step_input_guards(entries) -> list[bool]:
    """Which of dynamo's guards to check before each compiled step: all but those on this
    object's attributes (the model's ~300 weights, its config, the KV pool), which never
    change while a worker lives. Checking them took ~2 ms a step (a tenth of a 2-core CPU's
    one-stream step); the guards on the step's own inputs still pick the bucket's graph.
    Safe only with `_own_code`: nothing then tells two CompiledDecodes' graphs apart."""
    return [not entry.name.startswith(_SELF_GUARDS) for entry in entries]


def _own_code(method):
    """`method` with a code object of its own: dynamo keeps compiled graphs per code object,
    so this instance's graphs (guarded on the step's inputs only) are never another's (the
    offline engines of one process, the tests)."""
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__,
                             func.__closure__)
    return types.MethodType(own, method.__self__)


class _LayerPart(torch.nn.Module):
    """One layer's weights beside the model and attention backend that every layer shares,
    held by a module: a nested compile region is stamped out again for calls whose inputs are
    tensors, constants and modules (dynamo re-checks the first trace's guards with this
    layer's attributes in place of the first layer's)."""

    def __init__(self, model, layer, attn: TorchAttentionBackend) -> None:
        super().__init__()
        self.model, self.layer, self.attn = model, layer, attn


def _decode_layer(part: _LayerPart, h: torch.Tensor, pending: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, k_buffer: torch.Tensor,
                  v_buffer: torch.Tensor, out_cache_loc: torch.Tensor, key_locs: torch.Tensor,
                  bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode batch (the model's layer_forward), with the layer's KV
    buffers, RoPE tables and attention mask as inputs: nothing in it depends on which layer
    it is, so its trace serves them all."""
    group = TorchAttentionBackend.decode_group_of(key_locs, bias)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(k_buffer, v_buffer, out_cache_loc, k, v)
        return part.attn.attend_in(q, k_buffer, v_buffer, group)

    # The layer adds into h in place and returns it; a region's output may not alias its input.
    h = h.clone() if pending is None else h + pending
    return part.model.layer_forward(part.layer, h, None,
                                    partial(apply_rope, cos=cos, signed_sin=sin), attend)


class CompiledDecode:
    """The decoder compiled per bucket of decode batch sizes up to ``max_batch``."""

    def __init__(self, model, attn: TorchAttentionBackend, max_batch: int,
                 background_buckets: bool = False) -> None:
        """`background_buckets`: buckets above 1 are built on a thread when a batch first
        needs one (steps run eagerly meanwhile), not in that step."""
        if not isinstance(attn, TorchAttentionBackend):
            raise ValueError(f"the compiled decode step traces the torch attention backend "
                             f"(got {type(attn).__name__})")
        self.model, self.attn = model, attn
        self.sizes = bucket_sizes(min(max_batch, COMPILE_MAX_BATCH))
        self.max_batch = self.sizes[-1]
        self.background_buckets = background_buckets
        self._compiled = None  # made at the first compile (_compiled_forward)
        self.ready: set[int] = set()  # buckets compiled
        self.failed: dict[int, str] = {}  # bucket -> why its compile failed (it runs eagerly)
        self.compile_s: dict[int, float] = {}  # bucket -> seconds its compile took
        self.runs = 0  # decode steps that ran compiled (tests and benchmarks read it)
        self.background: BackgroundCompile | None = None  # the bucket built on a thread
        self._threads_before_build: int | None = None  # the steps' threads, while one runs
        self._parts = [_LayerPart(model, layer, attn) for layer in model.layers]
        # Each layer's attention mask: the one of its window (attn.windows; Gemma 3 has two).
        self._bias_of_layer = [attn.windows.index(attn.layer_window(i))
                               for i in range(len(model.layers))]
        self._layer = _decode_layer  # a nested compile region once dynamo is imported

    def compile_in_background(self) -> BackgroundCompile:
        """Bucket 1 to be built on a thread (gpu/background_compile.py), started by the
        caller (the worker process once it has said it is ready); decode steps run eagerly
        until it is done."""
        return self._build_on_thread(1)

    def _build_on_thread(self, size: int) -> BackgroundCompile:
        """Bucket `size` to be built on a thread (not started): the one build at a time."""
        self.background = BackgroundCompile(partial(self.compile_now, size),
                                            name=f"fmserve-compile-{size}")
        return self.background

    @property
    def building(self) -> bool:
        """A bucket is being built on a thread: every decode step runs eagerly meanwhile
        (dynamo compiles into the function that a compiled step would call)."""
        return self.background is not None and not self.background.done

    @property
    def state(self) -> str:
        """"building" (a bucket is built on a thread; decode steps run eagerly meanwhile), "on"
        (bucket 1 is in use) or "failed" (every decode step runs eagerly), as in
        StepResult.decode_compile."""
        if self.building:
            return "building"
        return "on" if 1 in self.ready else "failed"

    def _compiled_forward(self):
        """torch.compile of the decoder, made when the first bucket compiles: importing dynamo
        and inductor takes ~1.3 s and ~150 MB, which a worker in the background compile pays
        after it is ready, not before."""
        if self._compiled is None:
            import torch._dynamo
            import torch._inductor.config as inductor_config

            _use_fmserve_cache_dir()
            inductor_config.emulate_precision_casts = True  # bf16 rounds where eager rounds
            # No shape and stride asserts in the generated code: the layer's code checked its
            # ~20 inputs at each of its 30 calls a step (~1 ms, 7% of a bf16 step); dynamo's
            # guards still check the step's own inputs.
            inductor_config.size_asserts = False
            # dynamo keeps one graph per bucket under one function (the shapes are its guards)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       2 * len(self.sizes))
            # One layer traced and compiled, its code called by every layer: a cold compile
            # takes about half the time of the whole decoder's (docs/benchmarks.md).
            self._layer = torch.compiler.nested_compile_region(_decode_layer)
            self._compiled = torch.compile(_own_code(self._forward), backend="inductor",
                                           dynamic=False,
                                           fullgraph=True,
                                           options={"guard_filter_fn": _step_input_guards})
        return self._compiled

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 out_cache_loc: torch.Tensor, key_locs: torch.Tensor,
                 biases: tuple[torch.Tensor, ...]) -> torch.Tensor:
        model, kv = self.model, self.attn.kv_pool
        h = model.embed_input(input_ids)
        tables = [rope.cos_sin(positions) for rope in model.ropes]
        pending = None
        for layer_id, part in enumerate(self._parts):
            cos, sin = tables[model.rope_of_layer[layer_id]]
            h, pending = self._layer(part, h, pending, cos, sin, kv.k_buffer[layer_id],
                                     kv.v_buffer[layer_id], out_cache_loc, key_locs,
                                     biases[self._bias_of_layer[layer_id]])
        return model.final_hidden(h, pending)

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              locs: torch.Tensor, max_len: int) -> torch.Tensor:
        biases = []
        for window in self.attn.windows:  # the key locations are the same under each
            key_locs, bias = self.attn.decode_inputs(slots, positions + 1, max_len, window)
            biases.append(bias)
        # Keys per request change every step: dynamic (>= 2: a decode follows a prefill).
        compiled = self._compiled_forward()
        torch._dynamo.mark_dynamic(key_locs, 1)
        for bias in biases:
            torch._dynamo.mark_dynamic(bias, 2)
        if ids.shape[0] >= 2:  # one graph for the buckets above 1 where the code allows
            for t in (ids, positions, locs, key_locs, *biases):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        with _without_function_modes():
            return compiled(ids, positions, locs, key_locs, tuple(biases))

    def bucket(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    @torch.inference_mode()
    def compile_now(self, size: int) -> None:
        """Compile one bucket here and now: a forward of padding rows only (they write only
        the padding page)."""
        if size in self.ready or size in self.failed:
            return
        start = time.perf_counter()
        # Distinct tensors: dynamo guards on which inputs alias, so one tensor passed as ids,
        # slots and locations would compile a graph that a real step (distinct tensors)
        # misses, and the first real decode would compile again.
        ids, positions, slots, locs = (torch.zeros(size, dtype=torch.int64,
                                                   device=self.model.device) for _ in range(4))
        try:
            self._call(ids, positions + 1, slots, locs, 2)
        except Exception as exc:  # the bucket runs eagerly; the log says why
            self.failed[size] = f"{type(exc).__name__}: {exc}"
            log.warning("compiling the decode step for batch %d failed (%s); it runs eagerly",
                        size, self.failed[size])
            return
        self.compile_s[size] = time.perf_counter() - start
        self.ready.add(size)
        log.info("decode step for batch %d compiled in %.1f s", size, self.compile_s[size])

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode batch within the buckets whose compile did not fail. The first batch of a
        bucket compiles it: in this step (it waits: ~8 s warm, ~25 s cold on 2 cores), or with
        `background_buckets` on a thread while this and later steps run eagerly. None while a
        bucket is built in the background: the switch comes at a step boundary."""
        self._share_cores(self.building)
        if batch.mode != ForwardMode.DECODE or not 0 < batch.batch_size <= self.max_batch:
            return False
        if self.building:
            return False
        size = self.bucket(batch.batch_size)
        if size not in self.ready and size not in self.failed:
            if self.background_buckets:
                log.info("building the decode step for batch %d on a thread (decode steps "
                         "run eagerly until it is built)", size)
                self._build_on_thread(size).start()
                return False
            self.compile_now(size)
        return size in self.ready

    def _share_cores(self, building: bool) -> None:
        """While a build runs, this thread's steps take one torch thread fewer: a team as
        wide as the cores stalls at its barriers whenever the build holds one."""
        if building and self._threads_before_build is None and torch.get_num_threads() > 1:
            self._threads_before_build = torch.get_num_threads()
            torch.set_num_threads(self._threads_before_build - 1)
        elif not building and self._threads_before_build is not None:
            torch.set_num_threads(self._threads_before_build)
            self._threads_before_build = None

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder over a decode batch, compiled: final hidden states [bs, H]."""
        bs = batch.batch_size
        size = self.bucket(bs)
        ids, positions, slots, locs = (batch.input_ids, batch.positions, batch.slots,
                                       batch.out_cache_loc)
        if size > bs:  # padding rows: slot 0, position 0 (length 1), KV location 0
            pad = torch.zeros(size - bs, dtype=ids.dtype, device=ids.device)
            ids, positions, slots, locs = (torch.cat([t, pad]) for t in
                                           (ids, positions, slots, locs))
        hidden = self._call(ids, positions, slots, locs, max(batch.max_seq_len, 2))
        self.runs += 1
        return hidden[:bs]
