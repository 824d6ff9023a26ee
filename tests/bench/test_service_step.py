"""scripts/bench_service_step.py: a real service with the instant worker (fmserve/bench/
instant_worker.py) serves every request to its length, and the table has each checkout's steps
a second, CPU a step and ratio (figures are not asserted, only that they are there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_instant_worker_serves_every_request_and_the_table_compares_two_checkouts(
        gguf_path):
    run = subprocess.run(
        [sys.executable, "scripts/bench_service_step.py", "--trees", "a=.,b=.", "--model",
         str(gguf_path), "--rounds", "2", "--concurrency", "2", "--requests-per-stream", "1",
         "--tokens", "12"],
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
