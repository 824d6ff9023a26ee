"""`fmserve bench http`: a tiny run end to end (one real service, the same load over ZMQ and
over the OpenAI API), whose rows must count every request and token."""

import re

import pytest

from fmserve.bench.peers_llama_server import find_llama_server
from fmserve.cli import main


def test_bench_http_runs_both_transports_and_states_the_ratios(tmp_path, model_path):
    md = tmp_path / "http.md"
    assert main(["bench", "http", "--model", str(model_path), "--dtype", "fp32",
                 "--concurrency", "2", "--requests-per-level", "3", "--max-new-tokens", "5",
                 "--rounds", "2", "--markdown", str(md),
                 "--llama-server", str(tmp_path / "no-llama-server")]) == 0
    text = md.read_text()
    rows = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
        if line.startswith("| HTTP") or line.startswith("| ZMQ"))}
    assert set(rows) == {"HTTP, concurrency 2", "ZMQ, concurrency 2"}
    for cells in rows.values():
        assert cells[1] == "6"  # 3 requests x 2 rounds, pooled
        assert float(cells[5]) > 0
    found = re.search(r"- concurrency 2: HTTP/ZMQ throughput ([\d.]+)x, TTFT p50 ([-+][\d.]+) ms",
                      text)
    assert found and float(found.group(1)) > 0, text


@pytest.mark.skipif(not find_llama_server(), reason="no llama-server binary (build one with "
                    "scripts/build_llama_server.sh and set FMSERVE_LLAMA_SERVER to run it)")
def test_bench_http_drives_llama_server_with_the_same_openai_load(tmp_path, model_path):
    md = tmp_path / "http.md"
    assert main(["bench", "http", "--model", str(model_path), "--dtype", "fp32",
                 "--concurrency", "2", "--requests-per-level", "2", "--max-new-tokens", "5",
                 "--rounds", "1", "--markdown", str(md)]) == 0
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| llama-server"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and float(cells[5]) > 0, row
    assert re.search(r"fmserve HTTP/llama-server throughput [\d.]+x", text), text
