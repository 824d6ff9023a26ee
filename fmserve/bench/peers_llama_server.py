"""The llama.cpp server peer of `fmserve bench peers`: `llama-server --parallel N` on the same
GGUF, driven over HTTP by C concurrent streaming clients, like `fmserve serve` is over ZMQ.

llama-server is a C++ binary that is not on PyPI; it is found as --llama-server, then
$FMSERVE_LLAMA_SERVER, then `llama-server` on PATH. Its slots batch continuously (llama.cpp's
default), so it is the llama.cpp a user would put behind several clients.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from fmserve.bench.peak_rss import RssSampler
from fmserve.bench.peer_types import PointResult, Req, llama_cpp_sampling, req_from_stamps

START_TIMEOUT_S = 180.0


def find_llama_server(explicit: str = "") -> str:
    """The llama-server binary to run, or "" when there is none."""
    for candidate in (explicit, os.environ.get("FMSERVE_LLAMA_SERVER", "")):
        if candidate:
            return candidate if os.access(candidate, os.X_OK) else ""
    return shutil.which("llama-server") or ""


def unused_cache_flags(binary: str) -> list[str]:
    """Flags that switch off llama-server's RAM prompt cache (`--cache-ram`, 8 GiB by default
    in newer builds), where the binary has it: it keeps finished slots' KV in memory for prompts
    that repeat, which these requests never reuse (cache_prompt false), and counted in the peak
    RSS (SmolLM2-135M, 32 slots: peak 572-573 MB with it, 529 MB without)."""
    try:
        text = subprocess.run([binary, "--help"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["--cache-ram", "0"] if "--cache-ram" in text else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerPeer:
    """One llama-server process with max(concurrency) slots, for every concurrency."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.slots = max(cfg.concurrency)
        self.port = _free_port()
        threads = cfg.threads or os.cpu_count() or 1
        # -c is the whole KV cache; llama-server splits it evenly over the slots
        cmd = [cfg.llama_server, "-m", cfg.model_path, "--host", "127.0.0.1",
               "--port", str(self.port), "-np", str(self.slots),
               "-c", str(cfg.max_context * self.slots), "-b", "512",
               "-t", str(threads), "-tb", str(threads), "--cont-batching",
               "-ngl", "999" if cfg.device == "cuda" else "0",
               *unused_cache_flags(cfg.llama_server)]
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _log_tail(self) -> str:
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-4:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}: "
                                   f"{self._log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server was not ready within {START_TIMEOUT_S:.0f} s: "
                           f"{self._log_tail()}")

    def one(self, prompt: list[int], max_new: int) -> Req:
        """One streamed completion: exactly max_new greedy (or sampled: cfg.sampling_fields)
        tokens, no prompt cache reuse (the prompts repeat across waves; fmserve and
        transformers reuse nothing either)."""
        sampling = llama_cpp_sampling(self.cfg)
        body = json.dumps(dict(prompt=prompt, n_predict=max_new, **sampling, ignore_eos=True,
                               cache_prompt=False, stream=True, return_tokens=True))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
        stamps, sizes, event = [], [], {}
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens"):
                stamps.append(time.perf_counter() - start)
                sizes.append(len(event["tokens"]))
            if event.get("stop"):
                break
        conn.close()
        # The server holds back a token that ends inside a UTF-8 character and sends it with a
        # later event, whose `tokens` then lists only that event's last token: the final
        # event's count is the truth, and the held-back tokens are spread over the events.
        got = int(event.get("tokens_predicted", sum(sizes)))
        missing = got - sum(sizes)
        for i in range(missing if sizes else 0):
            sizes[i % len(sizes)] += 1
        if got != max_new or sum(sizes) != got:
            why = {k: event.get(k) for k in ("stop_type", "truncated", "error") if k in event}
            raise RuntimeError(f"llama-server streamed {got} tokens, {max_new} were asked for "
                               f"(its last event: {why or event})")
        return req_from_stamps(stamps, sizes, time.perf_counter() - start)

    def measure(self, peer: str, concurrency: int, requests: list[list[int]]) -> PointResult:
        """Closed loop: `concurrency` client threads, each taking the next request when its
        last one finished."""
        self.one(requests[0][:8], 2)  # warm-up
        todo: queue.Queue = queue.Queue()
        for i, prompt in enumerate(requests):
            todo.put((i, prompt))
        done: list[Req | None] = [None] * len(requests)
        errors: list[BaseException] = []

        def client() -> None:
            while not errors:
                try:
                    i, prompt = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done[i] = self.one(prompt, self.cfg.max_new_tokens)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

        clients = [threading.Thread(target=client, daemon=True)
                   for _ in range(min(concurrency, len(requests)))]
        with RssSampler(lambda: [self.proc.pid]) as rss:
            start = time.perf_counter()
            for t in clients:
                t.start()
            for t in clients:
                t.join()
            wall = time.perf_counter() - start
        if errors:
            raise errors[0]
        return PointResult(concurrency, wall, [r for r in done if r is not None],
                           peak_rss=rss.peak)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
