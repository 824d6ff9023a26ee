#!/usr/bin/env bash
# Set up (scripts/setup.sh), then start the main job. Extra arguments are passed on, e.g.
#   scripts/run.sh --model path/to/model.gguf
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
# The main job is the service on the default model, configured by config.toml.
cd "$ROOT"
exec "${FMSERVE_VENV:-$ROOT/.venv}/bin/fmserve" serve "$@"
