"""The service process (`fmserve serve`) holds no torch: the CLI's parser and the service's
modules import none of it (the worker processes do). torch's import is ~200 MB of the
service's memory and ~1.5 s of its start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules_loaded_by(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", code + "; print(sorted(m for m in ('torch', "
                          "'gpu.worker', 'fmserve.engine', 'transformers') if m in sys.modules))"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])  # a list of names, printed by us


def test_the_cli_parser_and_the_service_import_no_torch():
    assert modules_loaded_by("import sys, fmserve.cli as c; c.build_parser()") == []
    assert modules_loaded_by("import sys, fmserve.serve_cmd, service.server") == []
