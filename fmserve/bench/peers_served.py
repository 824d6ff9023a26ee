"""The served peers of `fmserve bench peers`: `fmserve serve` (its scheduler and worker
processes) started per peer, driven by C concurrent clients over ZMQ."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from fmserve.bench.peak_rss import RssSampler, tree_pids
from fmserve.bench.peer_types import Peer, PeerConfig, PointResult, req_from_stamps

# How long a served peer waits for its worker's compiled decode step before measuring.
COMPILE_WAIT_S = 300.0


class ServedPeer:
    """`fmserve serve` (scheduler + worker processes) for one served peer."""

    def __init__(self, cfg: PeerConfig, peer: Peer) -> None:
        from fmserve.bench.serve import start_service
        extra = ["--max-kv-tokens", str(cfg.max_kv_tokens)]
        if cfg.threads:
            extra += ["--set", f"runtime.worker_cpu_threads={cfg.threads}"]
        if peer.spec != "off":
            algorithm, draft, steps, topk, tokens = cfg.spec[peer.spec]
            extra += ["--spec-algorithm", algorithm, "--spec-num-steps", str(steps),
                      "--spec-topk", str(topk), "--spec-num-draft-tokens", str(tokens)]
            extra += ["--draft-model", draft] if draft else []
        ns = SimpleNamespace(dtype=cfg.fmserve_dtype, device=cfg.device,
                             attention_backend=cfg.attention_backend)
        self.cfg = cfg
        self.proc, self.endpoint = start_service(ns, Path(cfg.model_path), peer.overlap, extra,
                                                 max_running_requests=max(cfg.concurrency))
        self.compiled_waited = False

    def _warm_up(self, prompt: list[int]) -> None:
        from fmserve.bench.serve import run_closed_loop
        from ipc.sampling import SamplingParams
        asyncio.run(run_closed_loop(self.endpoint, [prompt[:8]], 1,
                                    SamplingParams(max_new_tokens=2)))

    def _wait_for_the_compiled_step(self, prompt: list[int]) -> None:
        """The worker builds its compiled decode step on a thread once it is ready (~20 s
        warm, a minute or more cold on 2 cores), decoding eagerly meanwhile; the other peers
        are measured fully loaded, so this one is too. Its steps report the state."""
        from ipc.client import Client
        deadline = time.monotonic() + COMPILE_WAIT_S
        with Client(self.endpoint) as client:
            while client.health().decode_compile == "building":
                if time.monotonic() > deadline:
                    print(f"the compiled decode step was still building after "
                          f"{COMPILE_WAIT_S:.0f} s: measuring anyway", flush=True)
                    return
                time.sleep(1.0)
                self._warm_up(prompt)

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        from fmserve.bench.serve import run_closed_loop
        from ipc.sampling import SamplingParams
        self._warm_up(requests[0])
        if not self.compiled_waited:
            self._wait_for_the_compiled_step(requests[0])
            self.compiled_waited = True
        params = SamplingParams(**self.cfg.sampling_fields(),
                                max_new_tokens=self.cfg.max_new_tokens,
                                ignore_eos=True)
        with RssSampler(lambda: tree_pids(self.proc.pid)) as rss:
            run = asyncio.run(run_closed_loop(self.endpoint, requests, concurrency, params))
        reqs = []
        for t in run.timings:
            u = t.usage
            spec = {} if u is None else dict(spec_steps=u.spec_verify_steps,
                                             spec_accepted=u.spec_accepted_drafts,
                                             per_position=list(u.spec_accepted_per_position))
            reqs.append(req_from_stamps(t.stamps, t.sizes, t.e2e, **spec))
        return PointResult(concurrency, run.wall, reqs, peak_rss=rss.peak)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a service that will not stop is killed
            self.proc.kill()
            self.proc.wait()
