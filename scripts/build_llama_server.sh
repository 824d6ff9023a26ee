#!/usr/bin/env bash
# Build llama.cpp's server (the peer `fmserve bench peers` and `fmserve bench http` compare
# against) from the llama.cpp source that the llama-cpp-python sdist carries, so anyone can
# rerun the comparison with the package tools they already have. A few minutes on 2 cores.
#
#   scripts/build_llama_server.sh [--portable] [--jobs N] [--out DIR]
#
# Native (default): tuned for this CPU (-march=native: AVX2 / AVX-512 / AMX where present).
# --portable: GGML_NATIVE=OFF, for a binary to copy to another x86-64 machine: AVX, AVX2,
# FMA, F16C and BMI2, no AVX-512 (llama.cpp's CMake defaults), so also the peer to run
# against fmserve capped at AVX2 (FMSERVE_CPU_ISA=avx2, gpu/cpu_info.py).
# The binary ends in DIR (default ~/.cache/fmserve/llama-server/<native|portable>/bin/
# llama-server: outside the repo, whose tree holds only fmserve's own code); the script prints
# `export FMSERVE_LLAMA_SERVER=...` for the benches.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${FMSERVE_VENV:-$ROOT/.venv}/bin/python"
[[ -x "$PY" ]] || PY=python3
KIND=native
JOBS="$(nproc)"
OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --portable) KIND=portable ;;
        --jobs) JOBS="$2"; shift ;;
        --out) OUT="$2"; shift ;;
        *) echo "build_llama_server.sh: unknown argument $1 (see the header of this script)" >&2
           exit 2 ;;
    esac
    shift
done
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_server.sh: needs $tool (e.g. the" \
        "cmake and g++ packages of your system)" >&2; exit 1; }
done
WORK="${XDG_CACHE_HOME:-$HOME/.cache}/fmserve/llama-server"
OUT="${OUT:-$WORK/$KIND}"
mkdir -p "$WORK/src"

SDIST="$(ls "$WORK"/src/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
if [[ -z "$SDIST" ]]; then
    echo "[build] fetching the llama-cpp-python source distribution" >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$WORK/src"
    SDIST="$(ls "$WORK"/src/llama_cpp_python-*.tar.gz | head -1)"
fi
SRC="$WORK/src/$(basename "$SDIST" .tar.gz)"
[[ -d "$SRC" ]] || tar -xzf "$SDIST" -C "$WORK/src"
LLAMA="$SRC/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "build_llama_server.sh: $SDIST has no" \
    "vendor/llama.cpp" >&2; exit 1; }

NATIVE=ON; [[ "$KIND" == portable ]] && NATIVE=OFF
echo "[build] llama-server ($KIND) from $(basename "$SRC") with $JOBS jobs" >&2
cmake -S "$LLAMA" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="$NATIVE" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >"$OUT.cmake.log" 2>&1 \
    || { tail -20 "$OUT.cmake.log" >&2; exit 1; }
cmake --build "$OUT" --target llama-server -j "$JOBS" >"$OUT.build.log" 2>&1 \
    || { tail -20 "$OUT.build.log" >&2; exit 1; }
BIN="$OUT/bin/llama-server"
"$BIN" --version >&2 || true
echo "export FMSERVE_LLAMA_SERVER=$BIN"
