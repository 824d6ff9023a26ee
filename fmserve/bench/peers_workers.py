"""`fmserve bench peers`: the measurements that run inside one process, each peer group in a
child process of its own (spawned, so its memory is its own and its peak RSS means something).

A group is one loaded model serving several peers: transformers (batch 1, batched, prompt
lookup, assisted), llama.cpp (its Python API; its server is peers_llama_server), or
one fmserve offline `Engine` per speculation setting (overlap is an attribute of the engine,
so overlap off and on share the load).

The parent talks to a child over a pipe: the child answers ("ready", info) or ("error", text),
then for each ("measure", peer, concurrency, requests) one ("point", PointResult) or
("error", text), until ("quit",).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

from fmserve.bench.peak_rss import RssSampler
from fmserve.bench.peer_types import PointResult, Req, llama_cpp_sampling, req_from_stamps


# --- transformers -------------------------------------------------------------------------


class _Stamps:
    """A transformers streamer that only records when each step's tokens arrive."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.sizes: list[int] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:  # generate() first hands over the prompt
            self._prompt = False
            return
        self.stamps.append(time.perf_counter() - self.start)
        self.sizes.append(int(value.shape[-1]) if value.dim() == 2 else 1)

    def end(self) -> None:
        pass


class HFGroup:
    peers = ("hf-b1", "hf-batched", "hf-prompt-lookup", "hf-assisted")

    def __init__(self, cfg) -> None:
        import torch
        from transformers.utils import logging as hf_logging
        from pathlib import Path
        from fmserve.bench.transformers_model import load_transformers
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch, self.cfg = torch, cfg
        self.device = torch.device(cfg.device)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.model = load_transformers(Path(cfg.model_path), dtype).to(self.device)
        self.assistant = None
        if cfg.assistant_model:
            self.assistant = load_transformers(Path(cfg.assistant_model), dtype).to(self.device)
        self.forwards = 0

        def count(*_):
            self.forwards += 1
        self.model.register_forward_pre_hook(count)

    def generate(self, batch: list[list[int]], max_new: int, **extra) -> tuple[list[Req], float]:
        torch = self.torch
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=self.device)
        streamer = _Stamps()
        self.forwards = 0
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                                min_new_tokens=max_new, pad_token_id=0, streamer=streamer,
                                **self._sampling(), **extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        e2e = time.perf_counter() - streamer.start
        spec = {}
        if extra:  # assisted generation: every target forward verifies the candidates
            tokens = sum(streamer.sizes)
            spec = dict(spec_steps=self.forwards, spec_accepted=max(tokens - self.forwards, 0))
        return [req_from_stamps(streamer.stamps, streamer.sizes, e2e, **spec) for _ in batch], e2e

    def _sampling(self) -> dict:
        fields = self.cfg.sampling_fields()
        return dict(do_sample=True, **fields) if self.cfg.temperature > 0 else dict(
            do_sample=False)

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        extra = {}
        if peer == "hf-prompt-lookup":
            extra = dict(prompt_lookup_num_tokens=self.cfg.prompt_lookup_tokens)
        elif peer == "hf-assisted":
            if self.assistant is None:
                raise RuntimeError("no assistant model")
            extra = dict(assistant_model=self.assistant)
        batch = 1 if peer != "hf-batched" else concurrency
        self.generate([requests[0][:8]], 2, **extra)  # warm-up
        reqs, wall = [], 0.0
        for i in range(0, len(requests), batch):
            got, took = self.generate(requests[i:i + batch], self.cfg.max_new_tokens, **extra)
            reqs += got
            wall += took
        return PointResult(concurrency, wall, reqs)


# --- llama.cpp ----------------------------------------------------------------------------


class LlamaCppGroup:
    peers = ("llama-cpp",)

    def __init__(self, cfg) -> None:
        from llama_cpp import Llama
        self.cfg = cfg
        # llama-cpp-python's own default decodes on half the cores; every other peer uses all
        threads = cfg.threads or os.cpu_count() or 1
        self.llm = Llama(model_path=cfg.model_path, n_ctx=cfg.max_context, n_batch=512,
                         n_threads=threads, n_threads_batch=threads, verbose=False, seed=0,
                         n_gpu_layers=-1 if cfg.device == "cuda" else 0)
        self.eos = self.llm.token_eos()

    def one(self, prompt: list[int], max_new: int) -> Req:
        start = time.perf_counter()
        stamps, sizes = [], []
        sampling = llama_cpp_sampling(self.cfg)
        for _ in self.llm.create_completion(prompt=prompt, max_tokens=max_new, stream=True,
                                            logit_bias={self.eos: -1e9}, **sampling):
            stamps.append(time.perf_counter() - start)
            sizes.append(1)
        return req_from_stamps(stamps, sizes, time.perf_counter() - start)

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        self.one(requests[0][:8], 2)  # warm-up
        start = time.perf_counter()
        reqs = [self.one(p, self.cfg.max_new_tokens) for p in requests]
        return PointResult(concurrency, time.perf_counter() - start, reqs)


# --- fmserve offline engine ---------------------------------------------------------------


class OfflineGroup:
    def __init__(self, cfg, spec_name: str) -> None:
        from fmserve.engine import Engine
        from ipc.spec_settings import SpecSettings
        self.cfg = cfg
        spec = SpecSettings(*cfg.spec[spec_name]) if spec_name != "off" else None
        self.engine = Engine(model=cfg.model_path, device=cfg.device, dtype=cfg.fmserve_dtype,
                             attention_backend=cfg.attention_backend,
                             max_running_requests=max(cfg.concurrency),
                             max_kv_tokens=cfg.max_kv_tokens, progress=False, spec=spec)

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        """Closed loop: `concurrency` requests in flight, a new one as soon as one finishes."""
        from ipc.sampling import SamplingParams
        engine = self.engine
        engine.overlap = "overlap" in peer
        engine.generate([requests[0][:8]], SamplingParams(max_new_tokens=2))  # warm-up
        params = SamplingParams(**self.cfg.sampling_fields(),
                                max_new_tokens=self.cfg.max_new_tokens,
                                ignore_eos=True)
        pending = list(requests)
        began: dict[str, float] = {}
        chunks: dict[str, tuple[list[float], list[int]]] = {}
        reqs: list[Req] = []

        def submit() -> None:
            [(rid, _)] = engine.submit([pending.pop(0)], params)
            began[rid] = time.perf_counter()
            chunks[rid] = ([], [])

        start = time.perf_counter()
        for _ in range(min(concurrency, len(pending))):
            submit()
        for out in engine.run():
            now = time.perf_counter() - began[out.rid]
            stamps, sizes = chunks[out.rid]
            if out.token_ids:
                stamps.append(now)
                sizes.append(len(out.token_ids))
            if out.finished:
                reqs.append(req_from_stamps(stamps, sizes, now,
                                            spec_steps=out.spec_verify_steps,
                                            spec_accepted=out.spec_accepted_drafts,
                                            per_position=list(out.spec_accepted_per_position)))
                if pending:
                    submit()
        return PointResult(concurrency, time.perf_counter() - start, reqs)


# --- the child process --------------------------------------------------------------------


def make_group(cfg, group: str):
    if group == "hf":
        return HFGroup(cfg)
    if group == "llama-cpp":
        return LlamaCppGroup(cfg)
    if group.startswith("offline:"):
        return OfflineGroup(cfg, group.split(":", 1)[1])
    raise ValueError(f"unknown peer group {group!r}")


def child_main(conn, cfg, group: str) -> None:
    """Entry point of a spawned child: load the group, then answer measure requests."""
    if cfg.threads:
        import torch
        torch.set_num_threads(cfg.threads)
    try:
        runner = make_group(cfg, group)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as text
        conn.send(("error", f"{type(exc).__name__}: {exc}".strip()[:500]))
        return
    conn.send(("ready", os.getpid()))
    gpu = cfg.device == "cuda"
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            return
        _, peer, concurrency, requests = msg
        try:
            if gpu:
                import torch
                torch.cuda.reset_peak_memory_stats()
            with RssSampler(lambda: [os.getpid()]) as rss:
                point = runner.measure(peer, concurrency, requests)
            point.peak_rss = rss.peak
            if gpu:
                point.gpu_peak = int(torch.cuda.max_memory_allocated())
            conn.send(("point", point))
        except Exception as exc:  # noqa: BLE001
            detail = traceback.format_exc(limit=3)
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:300] + "\n" + detail[-800:]))


# --- the parent's side -------------------------------------------------------------------


class ChildGroup:
    """A spawned child process holding one model load (see this module's docstring)."""

    def __init__(self, cfg, group: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child, cfg, group), daemon=True)
        # transformers' GGUF loader draws a tqdm bar over ours; tqdm reads TQDM_DISABLE when
        # it is imported, which in a spawned child is before child_main runs
        before = os.environ.get("TQDM_DISABLE")
        os.environ["TQDM_DISABLE"] = "1"
        try:
            self.proc.start()
        finally:
            if before is None:
                del os.environ["TQDM_DISABLE"]
            else:
                os.environ["TQDM_DISABLE"] = before
        child.close()
        kind, detail = self._recv()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"could not load: {detail}")

    def _recv(self):
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                return "error", f"the process died (exit code {self.proc.exitcode})"
        return self.conn.recv()

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        self.conn.send(("measure", peer, concurrency, requests))
        kind, payload = self._recv()
        if kind != "point":
            raise RuntimeError(payload)
        return payload

    def close(self) -> None:
        try:
            self.conn.send(("quit",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
