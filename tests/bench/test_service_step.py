"""scripts/bench_service_step.py: a real service with the instant worker (fmserve/bench/
instant_worker.py) serves every request to its length, speculating or not, and the table has
each checkout's steps a second, CPU a step and ratio (figures are not asserted, only that they
are there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from fmserve.bench.instant_worker import worker_info
from ipc.spec_settings import SpecSettings
from ipc.worker_config import worker_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_instant_worker_serves_every_request_and_the_table_compares_two_checkouts(
        gguf_path):
    run = subprocess.run(
        [sys.executable, "scripts/bench_service_step.py", "--trees", "a=.,b=.", "--model",
         str(gguf_path), "--rounds", "2", "--concurrency", "2", "--requests-per-stream", "1",
         "--tokens", "12", "--tree-args", "b=--spec-algorithm eagle3"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr  # load() asserts every token came
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()
            if line.startswith("| a |") or line.startswith("| b |")]
    assert [(r[0], r[1]) for r in rows] == [("a", "2"), ("b", "2")], run.stdout
    for name, _, steps_s, cpu_ms, ratios, median in rows:
        assert float(steps_s) > 0 and float(cpu_ms) > 0
        assert len(ratios.split(",")) == 2 and median.endswith("x")
    assert rows[0][4] == "1.000, 1.000"  # the first checkout is the base


def test_the_instant_worker_announces_the_services_speculation(gguf_path):
    """As a real worker does (gpu/worker_state.py), so the service plans and counts as it does
    for EAGLE: the steps' reserve, the positions of the accept statistics."""
    spec = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4)
    info = worker_info(msgspec.json.encode(worker_config(model_path=str(gguf_path),
                                                         spec=spec)).decode())
    assert (info.spec_algorithm, info.spec_num_steps, info.spec_reserve_tokens) == (
        "eagle3", 3, spec.reserve_tokens) and spec.reserve_tokens > 0
    plain = worker_info(msgspec.json.encode(worker_config(model_path=str(gguf_path))).decode())
    assert (plain.spec_algorithm, plain.spec_num_steps, plain.spec_reserve_tokens) == (
        "none", 0, 0)
