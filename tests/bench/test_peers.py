"""`fmserve bench peers --quick` end to end on a tiny prompt set (issue 8).

Figures are not asserted, only that every section is there, every number is finite, peers that
did not run say "skipped" (never a zero), and the plots exist. Shrunk to three model loads
(transformers, one speculative offline engine serving overlap off and on, one service).
"""

import importlib.util
import json
import math
import os
import re

import pytest

from fmserve.bench.peer_types import PEERS as PEER_LIST
from fmserve.bench.peer_types import PeerResult, PointResult, Req
from fmserve.bench.peers_pairs import overlap_pairs, pairs_sections, spec_pairs
from fmserve.cli import main

PEERS = "hf-*,llama-cpp,llama-server,offline-chain,offline-overlap-chain,served"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def rows_of(report: str) -> list[list[str]]:
    rows = []
    for line in report.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def row_for(rows: list[list[str]], key: str) -> list[str]:
    return next(r for r in rows if f"(`{key}`)" in r[0])


def test_bench_peers_quick_end_to_end(tmp_path, model_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "Name three colours of the rainbow.",
        "Write one sentence about the sea and the sea and the sea.",
    ]))
    out = tmp_path / "bench"
    argv = ["bench", "peers", "--quick", "--model", str(model_path), "--prompts", str(prompts),
            "--num-prompts", "2", "--max-prompt-tokens", "24", "--max-new-tokens", "4",
            "--concurrency", "1,2", "--peers", PEERS, "--device", "cpu",
            "--out-dir", str(out), "--llama-server", str(tmp_path / "no-llama-server")]
    assert main(argv) == 0

    report = (out / "peers.md").read_text()
    for heading in ["# fmserve against its peers", "## Machine and settings", "## CPU",
                    "### Throughput and memory", "### Latency", "### Speculation",
                    "### Skipped", "### Plots", "## GPU"]:
        assert heading in report, heading
    assert "fmserve bench peers --quick" in report  # the exact command
    assert not re.search(r"\b(nan|inf|infinity)\b", report, re.IGNORECASE)

    rows = rows_of(report)
    for row in rows:
        for cell in row[1:]:
            if "skipped" in cell or not any(ch.isdigit() for ch in cell):
                continue
            for number in NUMBER.findall(cell):
                assert math.isfinite(float(number.replace(",", ""))), (row, cell)

    # ran: numbers, not "skipped"
    baseline = row_for(rows, "hf-b1")
    assert "skipped" not in baseline[1] and "(1.00x)" in baseline[1]
    assert "skipped" not in row_for(rows, "hf-batched")[3]  # output tok/s at 2 streams
    for key in ["offline-chain", "offline-overlap-chain", "served"]:
        row = row_for(rows, key)
        assert all("skipped" not in c for c in row[1:5]), row
    assert NUMBER.fullmatch(row_for(rows, "offline-chain")[-1])  # mean accept length
    # not run: "skipped" in every figure, never a zero
    for key in ["hf-assisted", "offline", "served-chain", "served-overlap-tree"]:
        assert all(c.startswith("skipped") for c in row_for(rows, key)[1:]), key
    if importlib.util.find_spec("llama_cpp") is None:
        assert all(c.startswith("skipped") for c in row_for(rows, "llama-cpp")[1:])
        assert "pip install llama-cpp-python" in report
    assert "--assistant-model" in report
    assert all(c.startswith("skipped") for c in row_for(rows, "llama-server")[1:])
    assert "no-llama-server is not an executable file" in report
    assert "scripts/build_llama_server.sh" in report  # how to build it
    pairs = re.findall(r"- `offline-overlap-chain` / `offline-chain` at C = (\d): ([\d.]+)x\n",
                       report)  # one round (--quick): one ratio, no median
    assert "### Overlap on / off, round by round" in report and [c for c, _ in pairs] == ["1", "2"]
    assert all(float(r) > 0 for _, r in pairs)

    for png in ["peers_throughput.png", "peers_latency_cdf.png", "peers_accept.png"]:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, png
        assert f"]({png})" in report
    raw = json.loads((out / "peers.json").read_text())
    assert raw["results"]["cpu"]["hf-b1"]["figures"]["1"]["output_tps"] > 0


def test_busy_cores_sees_a_spinning_neighbour():
    import subprocess
    import sys
    from fmserve.bench.peers import busy_cores
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\n"
                             "while time.time() < t: pass"])
    try:
        busy = busy_cores(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and 0.6 <= busy <= (os.cpu_count() or 1) + 0.01


def test_unknown_peer_names_are_refused_before_any_work(tmp_path, capsys):
    # A --peers pattern that matched nothing silently ran the baseline alone (minutes).
    out = tmp_path / "bench"
    for peers, what in (("served,nosuch", "nosuch matches no peer"), ("", "names no peer")):
        assert main(["bench", "peers", "--quick", "--peers", peers, "--model",
                     str(tmp_path / "none.gguf"), "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert what in err and "served-overlap-tree" in err  # the peers are listed
    assert not out.exists()


# ----- impossible counts refused before running -----
# `bench peers` refuses impossible counts before it runs anything.

def test_cuts_without_a_temperature_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "bench"
    for extra, what in ((["--top-k", "40"], "give --temperature"),
                        (["--temperature", "0.8", "--top-p", "0"], "--top-p 0 keeps no token")):
        assert main(["bench", "peers", "--quick", "--model", str(tmp_path / "none.gguf"),
                     "--out-dir", str(out), *extra]) == 2
        assert what in capsys.readouterr().err
    assert not out.exists()


def test_only_the_running_speculative_peers_settings_are_checked(tmp_path, capsys):
    # --spec-num-steps 1 suits a chain; the tree peer's default 8 draft tokens do not. Both were
    # checked whatever ran, so a chain-only run with one step failed after minutes of set-up.
    out, model = tmp_path / "bench", str(tmp_path / "none.gguf")
    common = ["bench", "peers", "--quick", "--spec-num-steps", "1", "--model", model,
              "--out-dir", str(out)]
    assert main([*common, "--peers", "served-overlap-chain,served-overlap-tree"]) == 2
    assert "spec.num_draft_tokens must be" in capsys.readouterr().err  # the tree's, at once
    main([*common, "--peers", "served-overlap-chain"])  # gets as far as the missing model
    err = capsys.readouterr().err
    assert "num_draft_tokens" not in err and "none.gguf" in err, err[-2000:]
    assert not out.exists()


def test_the_report_names_the_speculative_settings_of_the_shapes_that_ran():
    from fmserve.bench.peers_report import spec_words
    chain, tree = ["eagle3", "", 1, 1, 2], ["eagle3", "", 3, 2, 4]
    assert spec_words({"chain": chain}) == "chain ('eagle3', '', 1, 1, 2)"
    assert spec_words({"chain": chain, "tree": tree}) == (
        "chain ('eagle3', '', 1, 1, 2), tree ('eagle3', '', 3, 2, 4)")
    assert spec_words({}) == "none ran"


def test_the_report_says_how_a_run_sampled():
    from fmserve.bench.peers_report import sampling_words
    assert sampling_words(0.0, dict(top_k=40, top_p=1.0, min_p=0.0)) == "greedy"
    assert sampling_words(0.8, dict(top_k=0, top_p=1.0, min_p=0.0)) == (
        "sampled at temperature 0.8, no top-k, top-p or min-p cut")
    assert sampling_words(0.8, None).endswith("no top-k, top-p or min-p cut")  # older reports
    assert sampling_words(0.7, dict(top_k=40, top_p=0.95, min_p=0.05)) == (
        "sampled at temperature 0.7, top-k 40, top-p 0.95, min-p 0.05")
    assert sampling_words(1.0, dict(top_k=0, top_p=0.9, min_p=0.0)).endswith(", top-p 0.9")


@pytest.mark.parametrize("flag, value", [("--threads", "-1"), ("--prompt-lookup-tokens", "0"),
                                         ("--top-p", "1.5"), ("--min-p", "-0.1"),
                                         ("--top-k", "-3")])
def test_bench_peers_refuses_impossible_counts_before_running(flag, value):
    # Both ran a whole benchmark with them before (torch given -1 threads, a lookup of 0).
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fmserve.cli", "bench", "peers", flag, value,
                          "--quick"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and flag in run.stderr, run.stderr[-2000:]


class _Recorder:
    """Stands in for a peer's runner (a service, llama-server, a child process): records when
    it starts, measures and closes. run_device's order is what is tested, not the runners."""

    log: list[tuple] = []

    def __init__(self, cfg, peer=None) -> None:
        self.key = peer.key if peer is not None else "llama-server"
        self.log.append(("start", self.key))

    def measure(self, key, concurrency, requests):
        from fmserve.bench.peer_types import PointResult
        self.log.append(("measure", key, concurrency))
        return PointResult(concurrency, 1.0, [])

    def close(self) -> None:
        self.log.append(("close", self.key))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rounds_points_are_taken_concurrency_by_concurrency_on_the_cpu(monkeypatch, device):
    """On the CPU a point's peers run seconds apart (all started first), every other round in
    reverse; on a GPU one peer at a time, as its service sizes its KV cache by the free
    memory."""
    from types import SimpleNamespace

    from fmserve.bench import peers
    from fmserve.bench.peer_types import PeerResult
    monkeypatch.setattr(peers, "ServedPeer", _Recorder)
    monkeypatch.setattr(peers, "LlamaServerPeer", _Recorder)
    _Recorder.log = []
    active = [p for p in peers.PEERS if p.key in ("llama-server", "served", "served-overlap")]
    results = {p.key: PeerResult(p) for p in active}
    cfg = SimpleNamespace(device=device, concurrency=[1, 8])
    progress = SimpleNamespace(advance=lambda *a, **k: None, update=lambda *a, **k: None)
    timings: list[dict] = []
    peers.run_device(cfg, [[1, 2, 3]], active, results, 2, progress, None, timings)
    log = _Recorder.log
    keys = [p.key for p in active]
    if device == "cpu":  # the second round in reverse: which peer goes first evens out
        for rnd, order in ((log[:12], keys), (log[12:], keys[::-1])):
            assert rnd[:3] == [("start", k) for k in order]
            assert rnd[3:9] == [("measure", k, c) for c in (1, 8) for k in order]
            assert sorted(rnd[9:]) == sorted(("close", k) for k in keys)
    else:
        assert log == 2 * [e for k in keys for e in
                           (("start", k), ("measure", k, 1), ("measure", k, 8), ("close", k))]
    assert all(len(results[k].points[c]) == 2 for k in keys for c in (1, 8))
    assert [t["peers"] for t in timings] == (keys + keys[::-1] if device == "cpu" else 2 * keys)


def test_overlap_pairs_are_each_rounds_ratio_to_the_twin_and_their_median():
    def point(tokens: int, wall: float) -> PointResult:
        return PointResult(8, wall, [Req(0.1, wall, tokens, [])])

    by_key = {p.key: p for p in PEER_LIST}
    results = {
        "served": PeerResult(by_key["served"], points={8: [point(100, 1.0), point(100, 2.0)]}),
        "served-overlap": PeerResult(by_key["served-overlap"],
                                     points={8: [point(110, 1.0), point(45, 1.0)]}),
        "offline-chain": PeerResult(by_key["offline-chain"], skipped="not selected"),
        "offline-overlap-chain": PeerResult(by_key["offline-overlap-chain"],
                                            points={8: [point(100, 1.0)]}),
    }
    assert overlap_pairs(results) == [
        "- `served-overlap` / `served` at C = 8: 1.100x 0.900x; median 1.000x"]


def test_spec_pairs_are_each_served_eagle_rounds_ratio_to_its_twin_without_speculation():
    def point(tokens: int, wall: float) -> PointResult:
        return PointResult(8, wall, [Req(0.1, wall, tokens, [])])

    by_key = {p.key: p for p in PEER_LIST}
    results = {
        "served-overlap": PeerResult(by_key["served-overlap"],
                                     points={1: [point(50, 1.0)], 8: [point(100, 1.0),
                                                                      point(100, 2.0)]}),
        "served-overlap-chain": PeerResult(by_key["served-overlap-chain"], points={
            1: [point(80, 1.0)], 8: [point(96, 1.0), point(51, 1.0)]}),
        "served-tree": PeerResult(by_key["served-tree"], points={8: [point(100, 1.0)]}),
        "offline": PeerResult(by_key["offline"], points={8: [point(100, 1.0)]}),
        "offline-chain": PeerResult(by_key["offline-chain"], points={8: [point(200, 1.0)]}),
    }
    # served-tree's twin (served) did not run; offline peers are not paired
    assert spec_pairs(results) == [
        "- `served-overlap-chain` / `served-overlap` at C = 1: 1.600x",
        "- `served-overlap-chain` / `served-overlap` at C = 8: 0.960x 1.020x; median 0.990x"]
    report = pairs_sections(results)
    assert "### Speculation on / off, round by round" in report
    assert "### Overlap on / off, round by round" not in report  # no overlap twin ran
