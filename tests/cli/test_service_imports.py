"""The service process (`fmserve serve`) holds no torch: the CLI's parser and the service's
modules import none of it (the worker processes do). torch's import is ~200 MB of the
service's memory and ~1.5 s of its start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


HEAVY = ("torch", "gpu.worker", "fmserve.engine", "transformers")
# What the other commands import: the benchmarks (rich, httpx), the monitor (textual), the client.
OTHER_COMMANDS = ("fmserve.bench.peers", "fmserve.bench.serve", "fmserve.bench.spec",
                  "fmserve.top_cmd", "fmserve.client_cmd", "textual", "rich", "httpx2")


def modules_loaded_by(code: str, names: tuple[str, ...] = HEAVY) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", code + f"; print(sorted(m for m in {names!r} "
                          "if m in sys.modules))"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])  # a list of names, printed by us


def test_the_cli_parser_and_the_service_import_no_torch():
    assert modules_loaded_by("import sys, fmserve.cli as c; c.build_parser()") == []
    assert modules_loaded_by("import sys, fmserve.serve_cmd, service.server") == []


def test_the_serve_command_imports_no_other_commands_modules():
    """`fmserve serve` gets its own arguments only: the benchmarks' and the monitor's modules
    (~5 MB of the service's resident set) stay out, while `fmserve --help` still lists them."""
    serve = "import sys, fmserve.cli as c; c.build_parser(['serve'])"
    assert modules_loaded_by(serve + "; import service.server", OTHER_COMMANDS) == []
    # The same parser with no command named builds every command, so the check can fail.
    assert modules_loaded_by("import sys, fmserve.cli as c; c.build_parser()",
                             OTHER_COMMANDS) != []
