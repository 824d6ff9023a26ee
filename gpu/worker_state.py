"""The worker's device state, shared by both step classes (gpu/plain_step.py,
gpu/eagle/eagle_step.py): weights, the KV pool, `req_to_token`, per-slot sampling state, the
FutureMap relay buffers (`output_tokens_buf`: each slot's next input token;
`new_seq_lens_buf`: its length in the cache) and the attention backend, all built once from a
WorkerConfig.

The bookkeeping every step shares lives here: `apply_plan` (released slots, new requests,
page grants), `prefill_chunks` (a plan's prefill inputs on the device) and `commit` (the
FutureMap's write half after sampling: publish, stash, record). The forwards, the KV writes
and EAGLE's relay of its draft state are the step classes' own.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu import cpu_q4_kernel
from gpu.attention.factory import make_attention_backend, resolve_attention_backend
from gpu.codes_layout import codes_capacity
from gpu.cpu_decode_step import half_kv_supported
from gpu.cpu_dtype import auto_dtype_for_codes, codes_dtype_applies
from gpu.cpu_kernels import fp32_split_applies, plan_fp32_split
from gpu.device import device_kind, host_to_device, resolve_device, resolve_dtype
from gpu.dp_attention import AttentionDataParallel
from gpu.future_map import FutureMap
from gpu.heap import release_free_heap
from gpu.huge_pages import codes_in_huge_pages
from gpu.kv_cache import KVPool, ReqToTokenPool
from gpu.llama import LlamaModel
from gpu.loader.load import load_model
from gpu.plan_check import check_plan
from gpu.q4_linear import q4_applies
from gpu.sampler import Sampler
from gpu.sampling_state import SampleOutput, SamplingState
from gpu.step_streams import StepStreams
from gpu.sync_guard import no_host_sync, sync_check_from_env
from gpu.tensor_parallel import TensorShard
from ipc.worker_config import WorkerConfig
from ipc.worker_messages import (WORKER_PROTOCOL_VERSION, ExtendEntry, StepPlan, WorkerInfo,
                                 unpack_i32)


@dataclass
class PrefillChunks:
    """A plan's prefill chunks on the device, their new tokens concatenated in plan order."""
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slots: torch.Tensor  # [n] int64
    prefix_lens: torch.Tensor  # [n] int64
    extend_lens: torch.Tensor  # [n] int64
    starts: torch.Tensor  # [n] int64: each chunk's first row in input_ids
    extend_lens_host: np.ndarray  # [n] int64


class WorkerState:
    def __init__(self, cfg: WorkerConfig) -> None:
        cfg = cfg.validate()
        self.cfg = cfg
        rt = cfg.runtime
        self.device = resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        if self.dtype == torch.bfloat16 and codes_dtype_applies(cfg, self.device):
            self.dtype = auto_dtype_for_codes()  # bf16 or fp32 on the codes, by speed here
        if self.device.type == "cpu" and rt.worker_cpu_threads > 0:
            torch.set_num_threads(rt.worker_cpu_threads)
        # Tensor parallelism (parallel.tp > 1): this rank's part of the model, over the group
        # gpu/tp_ranks.py started; None on one rank.
        # DP attention instead (parallel.dp_attention): the ranks cut the MLP only and run
        # requests of their own, so they neither agree on tokens nor share a seed.
        par = cfg.parallel
        self.shard = (TensorShard.join(par.tp, self.device)
                      if par.tp > 1 and not par.dp_attention else None)
        self.dp_attention = (AttentionDataParallel.join(par.tp, self.device)
                             if par.dp_attention else None)
        ranked = self.shard or self.dp_attention  # this rank's cut of the model, or None
        if ranked is not None and self.device.type == "cuda":  # one GPU per rank
            self.device = torch.device("cuda", ranked.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        # Forwards run with no request of this rank (idle batches): "step" (a plan without
        # requests), "target" and "draft" (a target or EAGLE draft forward of zero tokens).
        self.idle_counts: Counter[str] = Counter()
        # An fp32 model on a CPU without native bf16 keeps the codes too (gpu/cpu_kernels.py).
        split = cfg.weight_quant == "none" and fp32_split_applies(
            self.device, self.dtype, cfg.model.dtype, rt.q4_max_tokens, rt.cpu_fp32_weights)
        keep_q4 = cfg.weight_quant == "none" and (split or q4_applies(
            self.device, self.dtype, rt.q4_max_tokens))
        loaded = load_model(cfg.model.path, dtype=self.dtype, progress=cfg.progress,
                            keep_q4=keep_q4)
        self.model_config = mc = loaded.config
        fp32_split = (plan_fp32_split(mc.hidden_size, mc.intermediate_size, mc.vocab_size)
                      if split and loaded.q4 else None)
        self.fp32_split = fp32_split  # the EAGLE head's wide forwards multiply as the target's
        self.model_name = Path(cfg.model.path).name
        # The rank's heads and MLP slice (the whole model on one rank); vocab_size is the model's.
        local = ranked.shard_weights(loaded) if ranked is not None else mc
        self.max_context_len = min(rt.max_context_len or mc.max_context_len, mc.max_context_len)
        self.page_size = rt.page_size
        num_pages = -(-rt.max_kv_tokens // rt.page_size) + 1  # page 0 is padding
        # A request's positions stay below its KV slots and its context limit, plus the few a
        # speculative step drafts past the limit (below).
        max_positions = (min(self.max_context_len, (num_pages - 1) * rt.page_size)
                         + cfg.spec.reserve_tokens)
        # The codes one after another in huge pages (gpu/huge_pages.py): each step streams them.
        capacity = codes_capacity([w for ws in loaded.q4.values() for w in ws] + [
            w for w in (loaded.lm_head_q4,) if w is not None]) if fp32_split is not None else 0
        with codes_in_huge_pages(capacity):
            self.model = LlamaModel(local, loaded.weights, self.device, self.dtype,
                                    weight_quant=cfg.weight_quant, q4=loaded.q4,
                                    q4_max_tokens=rt.q4_max_tokens,
                                    lm_head_q4=loaded.lm_head_q4,
                                    deterministic=rt.deterministic, fp32_split=fp32_split,
                                    max_positions=max_positions, consume_weights=True)
        if ranked is not None:
            ranked.parallelize(self.model)
        del loaded
        release_free_heap()
        self.num_slots = rt.max_running_requests + 1  # slot 0 is padding
        # fp16 keys and values beside an fp32 model on its codes (runtime.kv_cache_dtype),
        # where the C decode step can read them (or torch's kernels take every step).
        half_kv = (rt.kv_cache_dtype == "auto" and fp32_split is not None
                   and (half_kv_supported() or cpu_q4_kernel.library() is None))
        self.kv_pool = KVPool(mc.num_layers, num_pages, rt.page_size, local.num_kv_heads,
                              mc.head_dim, torch.float16 if half_kv else self.dtype,
                              self.device)
        # Under speculation a request near the context limit still drafts and verifies a few
        # positions past it (the scheduler discards those tokens): its row has room for them.
        self.req_to_token = ReqToTokenPool(self.num_slots,
                                           self.max_context_len + cfg.spec.reserve_tokens,
                                           rt.page_size, self.device)
        self.attention_backend = resolve_attention_backend(rt.attention_backend, self.device,
                                                           rt.deterministic)
        self.attn = make_attention_backend(self.attention_backend, self.kv_pool, self.req_to_token,
                                           local.num_heads, local.num_kv_heads, mc.head_dim,
                                           mc.sliding_window, deterministic=rt.deterministic,
                                           scale=mc.attn_scale, window_layers=mc.window_layers)
        unseeded = (None if self.shard is None
                    else random.Random(self.shard.shared_seed(self.device)))
        self.sampling_state = SamplingState(self.num_slots, mc.vocab_size, self.device,
                                            eos_token_ids=mc.eos_token_ids, unseeded=unseeded)
        self.sampler = Sampler(self.sampling_state)
        # The env variables turn the debug checks on in workers the tests start.
        self.future_map = FutureMap(self.num_slots, self.device, rt.wrwr_check or None)
        self.sync_check = rt.sync_check or sync_check_from_env()
        self.streams = StepStreams(self.device)

    def info(self) -> WorkerInfo:
        mc, spec = self.model_config, self.cfg.spec
        return WorkerInfo(
            protocol_version=WORKER_PROTOCOL_VERSION, model_name=self.model_name,
            device=device_kind(self.device), dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.attention_backend, num_layers=mc.num_layers,
            vocab_size=mc.vocab_size, max_context_len=self.max_context_len,
            page_size=self.page_size, num_pages=self.kv_pool.num_pages,
            num_slots=self.num_slots, eos_token_ids=list(mc.eos_token_ids),
            spec_algorithm=spec.algorithm, spec_num_steps=spec.num_steps if spec.enabled else 0,
            spec_reserve_tokens=spec.reserve_tokens)

    def launch_checks(self):
        """no_host_sync around preparing and launching when sync_check is on (debug)."""
        return no_host_sync(self.device) if self.sync_check else contextlib.nullcontext()

    def apply_plan(self, plan: StepPlan) -> None:
        """The plan's bookkeeping: released slots forget their sampling state and FutureMap
        entries, new requests get theirs, granted pages enter `req_to_token`."""
        check_plan(plan, self.num_slots, self.kv_pool.num_pages,
                   self.req_to_token.max_context_len, self.model_config.vocab_size)
        released = unpack_i32(plan.released_slots)
        for slot in released.tolist():
            self.sampling_state.release(slot)
        if released.size:
            self.future_map.release(host_to_device(released.astype(np.int64), self.device))
        for req in plan.new_requests:
            self.sampling_state.set_request(req.slot, req.params, [], req.output_start)
            if req.cached_ids:  # a borrowed prefix: no prefill chunk will carry it
                self.sampling_state.add_prefill_chunk(req.slot, unpack_i32(req.cached_ids), 0)
        self.req_to_token.grant_all([(g.slot, g.first_page_index, unpack_i32(g.pages))
                                     for g in plan.grants])

    def sample(self, hidden: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
               slots_host: np.ndarray) -> SampleOutput:
        """The next token of each row of `hidden` (one per slot): the lm_head's argmax in C
        without writing the logits where the batch only wants that (LlamaModel.lm_head_tokens),
        or its temperature draw the same way (Sampler.c_draw), else the logits through the
        sampler. Both steps sample so: the EAGLE step's plain
        decodes had written the logits first, ~8% of its worker's time at 8 streams."""
        flags = self.sampler.batch_flags(slots, slots_host)
        draw = None if flags.argmax_only else self.sampler.c_draw(slots, seq_lens, flags)
        if flags.argmax_only or draw is not None:  # a temperature draw: in the lm_head too
            tokens = self.model.lm_head_tokens(hidden, draw)
            if tokens is not None:
                return SampleOutput(tokens)
        return self.sampler.sample(self.model.logits(hidden, reuse=True), slots, seq_lens,
                                   slots_host=slots_host)

    def commit(self, slots: torch.Tensor, next_tokens: torch.Tensor,
               seq_lens: torch.Tensor | None = None, emitted: torch.Tensor | None = None,
               emitted_slots: torch.Tensor | None = None,
               weights: torch.Tensor | None = None) -> None:
        """The FutureMap's write half for one step's rows, after sampling: publish each slot's
        new length (None: published before the forward, see PlainStep), stash the token the
        next step resolves as its input, and record the emitted tokens for penalties and
        min_new_tokens (`emitted` defaults to `next_tokens`; EAGLE's verify rows emit several,
        weighted by whether each was accepted)."""
        if seq_lens is not None:
            self.future_map.publish(slots, seq_lens)
        self.check_ranks_agree(next_tokens)
        self.future_map.stash(slots, next_tokens)
        if emitted is None:
            self.sampling_state.record_outputs(slots, next_tokens)
        else:
            self.sampling_state.record_outputs(emitted_slots, emitted, weights=weights)

    def check_ranks_agree(self, tokens: torch.Tensor) -> None:
        """Debug, with the WRWR check: every tensor-parallel rank chose the same tokens (sampled,
        or drafted), so their FutureMaps and batches stay identical."""
        if self.shard is not None and self.future_map.wrwr_check:
            self.shard.check_same_tokens(tokens)

    def prefill_chunks(self, extends: list[ExtendEntry]) -> PrefillChunks:
        """The plan's prefill chunks (at least one) on the device; their tokens also enter
        their slots' sampling state."""
        dev = self.device
        ids = [unpack_i32(e.token_ids) for e in extends]
        for e, chunk in zip(extends, ids):
            self.sampling_state.add_prefill_chunk(e.slot, chunk, e.prefix_len)
        lens_host = np.array([len(c) for c in ids], dtype=np.int64)
        total = int(lens_host.sum())
        lens = host_to_device(lens_host, dev)
        prefix = host_to_device(np.array([e.prefix_len for e in extends], dtype=np.int64), dev)
        starts = torch.cumsum(lens, 0) - lens
        # output_size: without it repeat_interleave syncs the host with the device.
        positions = (torch.arange(total, device=dev)
                     - torch.repeat_interleave(starts - prefix, lens, output_size=total))
        return PrefillChunks(
            host_to_device(np.concatenate(ids).astype(np.int64), dev), positions,
            host_to_device(np.array([e.slot for e in extends], dtype=np.int64), dev), prefix,
            lens, starts, lens_host)
