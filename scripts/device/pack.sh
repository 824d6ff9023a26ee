#!/usr/bin/env bash
# Here (no GPU): pack what a GPU device machine lacks into .devcarry/ (git-ignored), three
# pieces, one per `run` call, since a call carries at most 64 MiB with the ~23 MB working tree:
#   .devcarry/p1  the Python wheels the device image lacks + the default model's first 35 MB
#   .devcarry/p2  the model's next 39 MB
#   .devcarry/p3  the rest of the model, its sha256, and ../shared's prompt data (gzipped)
# The device side (scripts/device/stage.sh) installs the wheels and joins the model once all
# three have arrived. See scripts/device/README.md for the calls.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${FMSERVE_VENV:-$ROOT/.venv}/bin/python"
MODEL="$("$PY" -m fmserve.default_model)"  # fetched first if it is not cached yet
PROMPTS="$ROOT/../shared/data/prompts"
OUT=.devcarry
rm -rf "$OUT" && mkdir -p "$OUT/p1/whl" "$OUT/p2" "$OUT/p3"

# Wheels for the device's Python (3.12, x86-64 manylinux), without dependencies: the image
# already has the rest (numpy, anyio, rich, jinja2, tokenizers, pytest, transformers, ...).
# Versions are this venv's, so both machines run the same code.
version() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
specs=()
for name in msgspec pyzmq gguf textual mdit-py-plugins platformdirs pytest-textual-snapshot syrupy \
        httpx2 httpcore2 truststore starlette uvicorn httptools prometheus-client; do
    v="$(version "$name")"
    [[ -n "$v" ]] || { echo "pack: $name is not installed in this venv (run make setup)" >&2; exit 1; }
    specs+=("$name==$v")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$OUT/p1/whl" "${specs[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

# The model in three pieces (35 + 39 MB + the rest; the tree is ~25 MB) and its checksum.
piece() {  # piece OFFSET COUNT FILE: COUNT bytes of the model from OFFSET (COUNT 0: the rest)
    local count=()
    (( $2 > 0 )) && count=(count="$2")
    dd if="$MODEL" of="$3" bs=1M iflag=skip_bytes,count_bytes skip="$1" "${count[@]}" status=none
}
piece 0 35000000 "$OUT/p1/model.part1"
piece 35000000 39000000 "$OUT/p2/model.part2"
piece 74000000 0 "$OUT/p3/model.part3"
(cd "$(dirname "$MODEL")" && sha256sum "$(basename "$MODEL")") > "$OUT/p3/model.sha256"
for f in dev.jsonl train.jsonl; do gzip -9 -c "$PROMPTS/$f" > "$OUT/p3/$f.gz"; done

du -sh "$OUT"/p1 "$OUT"/p2 "$OUT"/p3
tree_mb=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
for p in p1 p2 p3; do
    total=$(( tree_mb + $(du -sb "$OUT/$p" | cut -f1) ))
    (( total < 62 * 1024 * 1024 )) || echo "pack: warning: the tree + $p is $total bytes, over 64 MiB" >&2
done
echo "pack: done; carry .devcarry/p1, then p2, then p3 (scripts/device/README.md)"
