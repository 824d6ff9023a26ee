#!/usr/bin/env bash
# Set up (scripts/setup.sh), then start the main job. Extra arguments are passed on, e.g.
#   scripts/run.sh --model path/to/model.gguf
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
# Until the service exists the main job is an interactive chat with the default model.
exec "${FMSERVE_VENV:-$ROOT/.venv}/bin/fmserve" generate --chat "$@"
