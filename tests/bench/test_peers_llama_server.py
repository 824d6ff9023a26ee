"""The llama-server peer of `fmserve bench peers`: the binary lookup, the closed-loop HTTP
driver against a stand-in server that speaks llama-server's streaming protocol (the real binary
is not built on a fresh machine), and, where a real llama-server is given in
$FMSERVE_LLAMA_SERVER, the real thing on the default model."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from fmserve.bench.peer_types import PeerConfig
from fmserve.bench.peers_llama_server import LlamaServerPeer, find_llama_server

FAKE = Path(__file__).parent / "fakes" / "fake_llama_server.py"


def config(binary: str, model: str = "model.gguf", concurrency=(1, 4), max_new: int = 5):
    return PeerConfig(model, "cpu", "fp32", "torch", 1, max_new, list(concurrency),
                      max_kv_tokens=1024, max_context=128, spec={}, prompt_lookup_tokens=0,
                      assistant_model="", llama_server=binary)


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    stats = tmp_path / "stats.json"
    monkeypatch.setenv("FAKE_LLAMA_STATS", str(stats))
    return wrapper, stats


def test_find_llama_server(tmp_path, monkeypatch, fake_server):
    wrapper, _ = fake_server
    monkeypatch.delenv("FMSERVE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server() == str(wrapper)  # found on PATH
    assert find_llama_server(str(tmp_path / "missing")) == ""  # an explicit path wins, or nothing
    monkeypatch.setenv("FMSERVE_LLAMA_SERVER", str(tmp_path / "stats.json"))  # not executable
    assert find_llama_server() == ""


def test_closed_loop_keeps_c_streams_in_flight(fake_server):
    wrapper, stats = fake_server
    peer = LlamaServerPeer(config(str(wrapper)))
    try:
        requests = [[1, 2, 3]] * 12
        point = peer.measure("llama-server", 4, requests)
        seen = json.loads(stats.read_text())
        one = peer.measure("llama-server", 1, requests[:3])
        seen1 = json.loads(stats.read_text())
    finally:
        peer.close()
    assert peer.proc.poll() is not None  # close() stopped it
    assert seen["slots"] == 4  # started with max(concurrency) slots
    assert seen["max_in_flight"] == 4 and seen["requests"] == 12 + 1  # + the warm-up
    assert len(point.reqs) == 12 and all(r.tokens == 5 for r in point.reqs)
    assert all(len(r.itl) == 4 and 0 < r.ttft <= r.e2e for r in point.reqs)
    assert point.wall > 0 and point.peak_rss > 0
    assert seen1["requests"] == 13 + 1 + 3 and len(one.reqs) == 3


@pytest.mark.parametrize("has_flag", [True, False])
def test_the_ram_prompt_cache_is_off_where_the_binary_has_it(fake_server, monkeypatch, has_flag):
    """The requests never reuse a prompt: a build's RAM prompt cache would only add to its
    peak RSS. A build without the flag starts as before."""
    wrapper, stats = fake_server
    monkeypatch.setenv("FAKE_LLAMA_CACHE_RAM", "1" if has_flag else "0")
    peer = LlamaServerPeer(config(str(wrapper), concurrency=(1,)))
    try:
        peer.measure("llama-server", 1, [[1, 2]])
    finally:
        peer.close()
    assert json.loads(stats.read_text())["cache_ram"] == (0 if has_flag else None)


@pytest.mark.parametrize("temperature, cuts, sampling", [
    (0.0, {}, {"temperature": 0.0, "top_k": 1}),
    (0.8, {}, {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    (0.7, dict(top_k=40, top_p=0.95, min_p=0.05),
     {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),
])
def test_a_sampled_run_asks_for_its_own_cuts_not_llama_cpps_defaults(
        fake_server, temperature, cuts, sampling):
    wrapper, stats = fake_server
    cfg = config(str(wrapper))
    cfg.temperature = temperature
    for name, value in cuts.items():
        setattr(cfg, name, value)
    peer = LlamaServerPeer(cfg)
    try:
        peer.measure("llama-server", 1, [[1, 2, 3]] * 2)
    finally:
        peer.close()
    assert json.loads(stats.read_text())["sampling"] == sampling


def test_held_back_tokens_are_counted(fake_server, monkeypatch):
    wrapper, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_HOLD", "1")
    peer = LlamaServerPeer(config(str(wrapper), concurrency=(2,), max_new=7))
    try:
        point = peer.measure("llama-server", 2, [[1, 2]] * 2)
    finally:
        peer.close()
    # 7 tokens in 5 events (tokens 0 and 3 held back): all counted, and one gap per token
    # after the first chunk (which is given 2 of the held-back tokens)
    assert [r.tokens for r in point.reqs] == [7, 7]
    assert all(len(r.itl) == 7 - 2 for r in point.reqs)


def test_short_stream_is_an_error(fake_server, monkeypatch):
    wrapper, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_SHORT", "2")  # the warm-up asks for 2
    peer = LlamaServerPeer(config(str(wrapper), concurrency=(2,)))
    try:
        with pytest.raises(RuntimeError, match=r"streamed 0 tokens, 2 were asked for"):
            peer.measure("llama-server", 2, [[1, 2]] * 4)
    finally:
        peer.close()


def test_a_server_that_exits_is_a_clear_error(tmp_path):
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match="exited with code 3: error: failed to load model"):
        LlamaServerPeer(config(str(broken)))


@pytest.mark.skipif(not find_llama_server(os.environ.get("FMSERVE_LLAMA_SERVER", "")),
                    reason="no llama-server binary (set FMSERVE_LLAMA_SERVER to run it)")
def test_real_llama_server_on_the_default_model(model_path):
    peer = LlamaServerPeer(config(find_llama_server(), str(model_path), concurrency=(1, 2)))
    try:
        point = peer.measure("llama-server", 2, [[1, 2, 3, 4]] * 4)
    finally:
        peer.close()
    assert len(point.reqs) == 4 and all(r.tokens == 5 for r in point.reqs)
