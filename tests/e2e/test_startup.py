"""`fmserve serve` whose worker cannot load the model: the user sees one clear message (what
failed, the worker's one-line reason, where its full log is), never the worker's traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.service_process import ROOT
from tests.ports import free_port


def test_worker_load_failure_is_one_message_and_the_log_keeps_the_traceback(tiny_llama,
                                                                           tmp_path):
    # A truncated safetensors file passes fmserve serve's own checks (config.json is there and
    # the tokenizer loads from tokenizer.json): only the worker finds it broken.
    model = tmp_path / "broken-model"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run(
        [sys.executable, "-m", "fmserve.cli", "serve", "--model", str(model), "--dtype", "fp32",
         "--endpoint", f"tcp://127.0.0.1:{free_port()}",
         "--telemetry-endpoint", f"tcp://127.0.0.1:{free_port()}", "--http-port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 2, shown
    assert "Traceback" not in shown, shown
    assert "fmserve: error: the worker for" in proc.stderr and "failed to start" in proc.stderr
    assert "model.safetensors" in proc.stderr and "truncated or corrupt" in proc.stderr
    found = re.search(r"full log, with its traceback, is kept in (\S+\.log)", proc.stderr)
    assert found, proc.stderr
    log = Path(found.group(1))
    try:
        text = log.read_text()
        assert "Traceback (most recent call last)" in text and "ModelLoadError" in text
    finally:
        log.unlink(missing_ok=True)
