"""The decode step of a Llama model on the 4-bit codes as one C call (gpu/csrc/decode_step.c).

On a CPU without native bf16 an fp32 model's projections run fmserve's C kernel on the GGUF's
codes (gpu/cpu_q4_kernel.py). Even compiled, a one-stream step then spends a quarter of its
time in Python: inductor's wrapper makes ~420 calls a step, 120 of them projections through
torch's dispatcher. This step makes one: the decoder (norms, projections, RoPE, the KV write,
attention, SwiGLU, residuals) runs in C over the model's own tensors, as llama.cpp runs it.
The embedding lookup (a C call of its own where the table is codes), the cos/sin gather and
the lm_head stay outside this call.

It applies to decode batches of up to NATIVE_MAX_BATCH rows, on a Llama-like decoder (Llama,
Mistral, Qwen3, Gemma 3: q/k norms, sandwich norms, sliding windows, a second RoPE table, GELU)
in fp32 with an fp32 or fp16 KV cache, every projection one CodesLinear part (4-bit, 4-bit over
[x, x], Q8_0 or Q6_K codes). Elsewhere (biases, DP attention) `why_not` says what is missing and
decode steps stay on torch.
"""

from __future__ import annotations

import ctypes
import os

import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu_kernels import ENV_CODES_ROWS
from gpu.cpu_q4_kernel import CodesLinear, Q8Rows, library
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.sync_guard import expected_sync

# Decode batches of up to this many rows run in C, even where the projections hand wider
# forwards to their wide path sooner: the C step saves the torch step's per-op cost, which
# the extra integer work of more rows does not outweigh. Measured on the 2-core AVX2 EPYC with
# SmolLM2-135M (offline decode tok/s, C against the torch step on FBGEMM fp16 packs, the wide
# path then, best of 2):
# 4 rows 167 against 88, 8 rows 221 against 185, 16 rows 211 against 152, 32 rows 231 against
# 205. $FMSERVE_CPU_CODES_ROWS, where set, fixes this too (the test suite).
NATIVE_MAX_BATCH = 32
# ... and batches (and chunks) of up to the projections' hand-over to the wide path, but never
# more than this many rows: beyond, a chunk's attention (one row at a time in C, a score
# scratch of rows x heads x keys) is better left to the torch step's SDPA, whose projections
# still run on the C kernel.
NATIVE_MAX_ROWS = 128

# Prefill chunks whose requests have at most this many keys also run in C, in pieces of
# NATIVE_MAX_ROWS rows (each piece reads every weight once): over the dev prompts (34-175
# tokens, 32 at once) 25-30% faster than the torch step (its per-op cost and elementwise
# passes), even at 512 keys, but the C step attends one row at a time, so at 1024 keys it
# was 1.1x slower (SmolLM2-135M, 2-core AVX512-BF16 EPYC).
PIECES_MAX_KEYS = 512

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Q4Weight(ctypes.Structure):
    _fields_ = [("codes", _PTR), ("scale", _PTR), ("minimum", _PTR), ("out", _INT),
                ("in_features", _INT), ("kind", _INT), ("fp16", _INT), ("narrow", _INT)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _Q4Weight),
                ("o", _Q4Weight), ("gate_up", _Q4Weight), ("down", _Q4Weight),
                ("k_cache", _PTR), ("v_cache", _PTR), ("qk_norm", _PTR), ("attn_out_norm", _PTR),
                ("mlp_out_norm", _PTR), ("window", _INT), ("rope", _INT)]


class _Decoder(ctypes.Structure):
    _fields_ = [("layers", _INT), ("hidden", _INT), ("heads", _INT), ("kv_heads", _INT),
                ("head_dim", _INT), ("intermediate", _INT), ("kv_half", _INT),
                ("eps", _FLOAT),
                ("attn_scale", _FLOAT), ("final_norm", _PTR), ("layer", ctypes.POINTER(_Layer)),
                ("gelu", _INT)]


# decode_step.c's codes kinds: 4-bit over x, 4-bit over [x, x], Q8_0, Q6_K
_CODES_KIND = {("q4", "none"): 0, ("q4", "repeat"): 1, ("q8", 1): 2, ("q8", 2): 3}


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def half_kv_supported() -> bool:
    """Whether the C step can keep the KV cache in fp16 (the library was built with F16C)."""
    lib = library()
    return lib is not None and bool(lib.kv_half_supported())


def why_not(model, attn) -> str | None:
    """Why this model's decode steps cannot run in C (None: they can)."""
    cfg = model.config
    if library() is None:
        return "the C kernel is not built (no C compiler, or FMSERVE_NO_C_KERNEL)"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"it runs fp32 models on the CPU (this one: {model.dtype} on {model.device})"
    if not isinstance(attn, TorchAttentionBackend) or attn.kv_pool.dtype not in (
            torch.float32, torch.float16):
        return "it reads an fp32 or fp16 KV cache of the torch attention backend"
    if attn.kv_pool.dtype == torch.float16 and not half_kv_supported():
        return "this CPU has no F16C to read an fp16 KV cache"
    if model.dp_attention is not None or len(model.ropes) > 2:
        return "DP attention and more than two RoPE tables are not written in C"
    if (cfg.qkv_bias or cfg.mlp_activation not in ("silu", "gelu_tanh")
            or cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 8):
        return ("its decoder is not one the C step has (q/k/v biases, an activation but SiLU "
                "or GELU, a head_dim not a multiple of 8)")
    for layer in model.layers:
        for name in _PROJECTIONS:
            if _codes_kind(getattr(layer, name)) is None:
                return f"{name} is not one matrix of codes on the C kernels"
    return None


def _codes_kind(proj) -> int | None:
    """decode_step.c's kind of a projection's codes, None where it has none of them."""
    if not isinstance(proj, CodesLinear) or len(proj.rows) != 1:
        return None
    rows = proj.rows[0]
    if isinstance(rows, Q8Rows):
        return _CODES_KIND[("q8", rows.halves)] if rows.codes.shape[0] == rows.out else None
    return _CODES_KIND.get(("q4", proj.segments[0].widening))


def native_decode_applies(state) -> bool:
    """Whether a worker's (gpu/worker_state.py) decode steps can run in C: its model and
    backend allow it, and neither deterministic mode (one row at a time) nor tensor
    parallelism (collectives between layers) is on."""
    return not (state.cfg.runtime.deterministic or state.cfg.parallel.tp > 1
                or why_not(state.model, state.attn))


def _q4(proj: CodesLinear) -> _Q4Weight:
    rows = proj.rows[0]
    if isinstance(rows, Q8Rows):
        return _Q4Weight(rows.codes.data_ptr(), rows.scale.data_ptr(), None, rows.out,
                         proj.in_features, _codes_kind(proj), rows.fp16, rows.narrow)
    return _Q4Weight(rows.nibbles.data_ptr(), rows.scale.data_ptr(), rows.minimum.data_ptr(),
                     proj.out_features, proj.in_features, _codes_kind(proj), rows.fp16)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecode:
    """The decoder of `model` over decode batches of up to `max_batch` rows, in C."""

    def __init__(self, model, attn: TorchAttentionBackend) -> None:
        reason = why_not(model, attn)
        if reason is not None:
            raise ValueError(f"the C decode step cannot run this model: {reason}")
        self.model, self.attn, self.lib = model, attn, library()
        cfg = model.config
        rows = os.environ.get(ENV_CODES_ROWS, "").strip()
        self.max_batch = int(rows) if rows.isdigit() else min(NATIVE_MAX_ROWS, max(
            NATIVE_MAX_BATCH, model.kernel_max_rows or 0))
        kv = attn.kv_pool
        # The structs hold raw pointers: every tensor they name lives as long as the model.
        self._layers = (_Layer * cfg.num_layers)(*[
            _Layer(layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr(),
                   _q4(layer.qkv_proj), _q4(layer.o_proj), _q4(layer.gate_up_proj),
                   _q4(layer.down_proj), kv.k_buffer[i].data_ptr(), kv.v_buffer[i].data_ptr(),
                   _ptr(layer.qk_norm), _ptr(layer.attn_out_norm), _ptr(layer.mlp_out_norm),
                   cfg.layer_window(i) or 0, model.rope_of_layer[i])
            for i, layer in enumerate(model.layers)])
        self._decoder = self._segment(0, cfg.num_layers)
        self._segments: dict[tuple[int, ...], list[_Decoder]] = {}
        self.runs = 0  # decode steps that ran here (tests and benchmarks read it)

    def _segment(self, start: int, stop: int) -> _Decoder:
        """A decoder over layers [start, stop) (its final norm is applied, and read, only
        after the last layer)."""
        cfg, kv = self.model.config, self.attn.kv_pool
        first = ctypes.cast(ctypes.byref(self._layers, start * ctypes.sizeof(_Layer)),
                            ctypes.POINTER(_Layer))
        return _Decoder(stop - start, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.intermediate_size, int(kv.dtype == torch.float16),
                        cfg.rms_norm_eps, self.attn.scale, self.model.final_norm.data_ptr(),
                        first, int(cfg.mlp_activation == "gelu_tanh"))

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode == ForwardMode.DECODE and 0 < batch.batch_size <= self.max_batch

    def can_run_as_rows(self, batch: ForwardBatch) -> bool:
        """Whether an extend runs here as decode rows (`extend_rows`: an EAGLE verify, a
        short chunk)."""
        return (batch.mode == ForwardMode.EXTEND and 0 < batch.num_tokens <= self.max_batch
                and batch.max_seq_len is not None)

    def can_run_in_pieces(self, batch: ForwardBatch) -> bool:
        """Whether a causal extend of more rows runs here, in pieces of rows: its
        chunks' requests have at most PIECES_MAX_KEYS keys (decodes beside them any)."""
        if (batch.mode != ForwardMode.EXTEND or batch.tree_mask is not None
                or batch.seq_lens_cpu is None or batch.extend_lens_cpu is None):
            return False
        with expected_sync():  # the host copies of the lengths, on a CPU-only path
            chunks = batch.extend_lens_cpu.numpy() > 1
            return int(batch.seq_lens_cpu.numpy()[chunks].max(initial=0)) <= PIECES_MAX_KEYS

    def run_in_pieces(self, batch: ForwardBatch, capture_layers: tuple[int, ...] = ()
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A causal extend as decode rows, NATIVE_MAX_ROWS of them a call (each piece's keys and
        values are written before the next attends to them): final hidden states [tokens, H]
        and the captures of `run_capturing`, in token order."""
        rows, n = causal_rows(batch), batch.num_tokens
        piece = max(self.max_batch, NATIVE_MAX_ROWS)
        outs = [self.run_capturing(_row_slice(rows, a, min(a + piece, n)), capture_layers)
                for a in range(0, n, piece)]
        captured = [torch.cat(parts) for parts in zip(*(c for _, c in outs))]
        return torch.cat([h for h, _ in outs]), captured

    def extend_rows(self, batch: ForwardBatch) -> tuple[ForwardBatch, torch.Tensor | None]:
        """An extend as a decode batch of one row per new token, with each row's keys where
        they are not its request's first seq_len locations (a tree's verify)."""
        if batch.tree_mask is None:
            return causal_rows(batch), None
        return tree_rows(batch, self.attn.req_to_token.req_to_token)

    def run_capturing(self, batch: ForwardBatch, capture_layers: tuple[int, ...],
                      key_locs: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Like `run`, with the input residual stream of each of `capture_layers` too, as
        LlamaModel.hidden_states returns them (an EAGLE-3 head's features): the layers run
        in segments that end where a capture is taken."""
        capture_layers = tuple(sorted(set(capture_layers)))  # hidden_states' order
        if not capture_layers:
            return self.run(batch, key_locs=key_locs), []
        segments = self._segments.get(capture_layers)
        if segments is None:
            bounds = [0, *capture_layers, self.model.config.num_layers]
            segments = self._segments[capture_layers] = [
                self._segment(a, b) for a, b in zip(bounds, bounds[1:])]
        captured: list[torch.Tensor] = []
        out = self.run(batch, segments, captured, key_locs)
        return out, captured

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, segments: list[_Decoder] | None = None,
            captured: list[torch.Tensor] | None = None,
            key_locs: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder over a decode batch: final hidden states [bs, H]. With `segments`,
        a copy of the residual stream before each segment but the first goes to
        `captured`. `key_locs` [bs, max_seq_len] int32: each row's keys, where they are not
        the first seq_len locations of its request (`tree_rows`)."""
        model = self.model
        h = model.embed(batch.input_ids).contiguous()  # a fresh tensor: the C step adds into it
        if model.embed_scale is not None:
            h.mul_(model.embed_scale)
        positions = batch.positions
        tables = [(rope.cos[positions].contiguous(), rope.signed_sin[positions, 1].contiguous())
                  for rope in model.ropes]
        cos = (_PTR * len(tables))(*[c.data_ptr() for c, _ in tables])
        sin = (_PTR * len(tables))(*[s.data_ptr() for _, s in tables])
        max_len = batch.max_seq_len
        key_locs, seq_lens, out_loc = row_operands(batch, self.attn.req_to_token.req_to_token,
                                                   key_locs)
        out = torch.empty_like(h)
        for i, decoder in enumerate(segments or [self._decoder]):
            if i:  # the C step adds into h in place
                captured.append(h.clone())
            status = self.lib.decode_step(
                ctypes.byref(decoder), batch.batch_size, _PTR(h.data_ptr()), cos, sin,
                _PTR(key_locs.data_ptr()),
                max_len, _PTR(seq_lens.data_ptr()), _PTR(out_loc.data_ptr()),
                _PTR(out.data_ptr()), torch.get_num_threads())
            if status != 0:
                raise MemoryError(f"the C decode step could not allocate its scratch for "
                                  f"{batch.batch_size} rows of up to {max_len} keys")
        self.runs += 1
        return out


def row_operands(batch: ForwardBatch, table: torch.Tensor, key_locs: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a C step reads of a decode batch (one row per token): each row's key locations
    [rows, max_seq_len] int32 (its request's first ones in `table` unless given), its key
    count and its new token's location, int64; contiguous."""
    if key_locs is None:
        key_locs = table[batch.slots, :batch.max_seq_len]
    return (key_locs.to(torch.int32).contiguous(), batch.seq_lens.to(torch.int64).contiguous(),
            batch.out_cache_loc.to(torch.int64).contiguous())


def causal_rows(batch: ForwardBatch) -> ForwardBatch:
    """A causal extend (no tree mask) as a decode batch of one row per new token: the row of a
    request's j-th new token attends to its prefix and its first j + 1 new tokens, as the
    extend does, because the C step writes every row's key and value before any row attends.
    Rows keep the extend's token order, so hidden states and captures line up with it. No
    host sync: the row counts come from the token count."""
    n, lens, width = batch.num_tokens, batch.extend_lens, batch.max_extend_len
    if width is not None and width * batch.batch_size == n:  # all alike (an EAGLE step's)
        within = torch.arange(1, width + 1, device=lens.device)
        return _decode_rows(batch, batch.slots.repeat_interleave(width),
                            (batch.prefix_lens[:, None] + within).reshape(-1))
    row_slots = torch.repeat_interleave(batch.slots, lens, output_size=n)
    starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=n)
    within = torch.arange(n, device=lens.device) - starts
    seq_lens = torch.repeat_interleave(batch.prefix_lens, lens, output_size=n) + within + 1
    return _decode_rows(batch, row_slots, seq_lens)


def tree_rows(batch: ForwardBatch, table: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """An EAGLE tree's verify (T nodes a request, node j's KV at index prefix + j of its
    request's row of `table`, `tree_mask` [bs, T, T]: node j sees node i, itself included) as
    one decode row per node: its keys are the prefix, then its ancestors and itself in column
    order, [bs * T, max_seq_len] int32 (past a row's seq_len: never read)."""
    mask = batch.tree_mask.to(torch.bool)
    bs, t = mask.shape[:2]
    if bs * t != batch.num_tokens:
        raise ValueError(f"a tree verify of {bs} requests x {t} nodes came with "
                         f"{batch.num_tokens} tokens")
    cols = torch.arange(t, device=mask.device)
    prefix = batch.prefix_lens
    request_keys = table[batch.slots, :batch.max_seq_len]  # [bs, max_len]
    node_locs = request_keys.gather(1, prefix[:, None] + cols)  # [bs, T]
    # Per node: the columns it sees in ascending order, then T (a pad, past its seq_len).
    seen = torch.where(mask, cols, t).sort(dim=-1).values  # [bs, T, T]
    padded = torch.cat([node_locs, node_locs[:, :1]], dim=1)
    seen_locs = padded.gather(1, seen.reshape(bs, t * t)).view(bs, t, t)
    keys = request_keys[:, None, :].expand(bs, t, -1).clone()
    keys.scatter_(2, (prefix[:, None, None] + cols).expand(bs, t, t), seen_locs)
    seq_lens = (prefix[:, None] + mask.sum(-1)).reshape(-1)  # prefix + depth + 1
    return _decode_rows(batch, batch.slots.repeat_interleave(t), seq_lens), keys.view(bs * t, -1)


def _row_slice(rows: ForwardBatch, start: int, stop: int) -> ForwardBatch:
    """Rows [start, stop) of a batch of decode rows (`causal_rows`)."""
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=rows.input_ids[start:stop],
                        positions=rows.positions[start:stop], slots=rows.slots[start:stop],
                        seq_lens=rows.seq_lens[start:stop],
                        prefix_lens=rows.prefix_lens[start:stop],
                        extend_lens=rows.extend_lens[start:stop],
                        out_cache_loc=rows.out_cache_loc[start:stop], max_seq_len=rows.max_seq_len)


def _decode_rows(batch: ForwardBatch, row_slots: torch.Tensor, seq_lens: torch.Tensor
                 ) -> ForwardBatch:
    """The extend's tokens as a decode batch: one row each, of its request's slot, with the
    keys up to `seq_lens`."""
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=batch.input_ids,
                        positions=batch.positions, slots=row_slots, seq_lens=seq_lens,
                        prefix_lens=seq_lens - 1, extend_lens=torch.ones_like(seq_lens),
                        out_cache_loc=batch.out_cache_loc, max_seq_len=batch.max_seq_len)
