#!/usr/bin/env bash
# Prepare what `make run` and `make test` need. Idempotent: on a ready machine it skips pip
# (a stamp newer than pyproject.toml) and takes a few seconds.
#   1. a virtualenv, .venv in the repo (FMSERVE_VENV=/path to use another one, e.g. an existing venv)
#   2. torch: any torch the venv can already import is kept; otherwise torch==2.13.0
#   3. this project, editable, with the dev extra (pytest, transformers as a reference, ...)
#   4. the default model, fetched once into ~/.cache/fmserve/models (skipped when FMSERVE_MODEL is set)
# FMSERVE_PYTHON picks the interpreter that creates the venv (default: python3, else python3.1x).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FMSERVE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.fmserve-installed"
# On this project's machines `pip install torch==2.13.0` takes a CPU build that lies on local
# disk; plain `torch` (or any other version) with no torch present downloads a multi-GB CUDA build.
TORCH_SPEC="${FMSERVE_TORCH_SPEC:-torch==2.13.0}"

log() { echo "[setup] $*" >&2; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# pip on this project's machines warns about every package missing from its local file indexes;
# harmless, and hundreds of lines, so those lines are dropped (pip's exit status is kept).
pip_quiet() {
    "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }

find_base_python() {
    if [[ -n "${FMSERVE_PYTHON:-}" ]]; then
        python_ok "$FMSERVE_PYTHON" || die "FMSERVE_PYTHON=$FMSERVE_PYTHON is not a Python >= 3.11"
        echo "$FMSERVE_PYTHON"; return
    fi
    local candidate
    for candidate in python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null && python_ok "$candidate"; then
            echo "$candidate"; return
        fi
    done
    die "fmserve needs Python >= 3.11: install it, or set FMSERVE_PYTHON=/path/to/python3.11"
}

# 1. The virtualenv.
if [[ ! -x "$PY" ]]; then
    BASE="$(find_base_python)"
    # Torch is gigabytes and a GPU machine's torch must match its driver: when the base Python
    # already has one (a CUDA/ROCm image), the venv sees the system site-packages and reuses it.
    # Otherwise the venv is isolated and step 2 installs the CPU build from local disk.
    VENV_FLAGS=()
    if "$BASE" -c 'import torch' >/dev/null 2>&1; then
        VENV_FLAGS=(--system-site-packages)
        log "reusing the torch of $BASE"
    fi
    log "creating $VENV with $("$BASE" --version)"
    "$BASE" -m venv "${VENV_FLAGS[@]}" "$VENV" \
        || die "could not create $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
fi

# 2 + 3. torch, then the project. The stamp records the repo path too: an editable install
# points at the source tree, so a moved checkout must reinstall.
if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" || "$(cat "$STAMP")" != "$ROOT" ]]; then
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
        log "installing $TORCH_SPEC"
        pip_quiet install -q "$TORCH_SPEC"
    fi
    log "installing fmserve (editable, with dev extras)"
    pip_quiet install -q -e "$ROOT[dev]"
    echo "$ROOT" > "$STAMP"
fi

# 4. The default model (the tests and `make run` use it). A cached model costs only a stat.
if [[ -z "${FMSERVE_MODEL:-}" ]]; then
    "$PY" -m fmserve.default_model >/dev/null || die "could not fetch the default model (see above)"
fi
