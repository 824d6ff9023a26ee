#!/usr/bin/env bash
# There (on the device machine), sourced by every device call: `source scripts/device/stage.sh`.
# Takes in whatever pieces of .devcarry/ this call carried (see pack.sh): installs the wheels
# into /tmp/site, keeps model pieces in /root/fmserve-stage (it outlives the call while the
# machine stays warm), and once all three are there joins and checks the model into fmserve's
# cache and unpacks the prompt data where ../shared would be. Then defines `step`.
STAGE=${FMSERVE_STAGE:-/root/fmserve-stage}
mkdir -p "$STAGE"
if compgen -G ".devcarry/p1/whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .devcarry/p1/whl/*.whl || { echo "stage: wheel install failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for p in p1 p2 p3; do
    [[ -d .devcarry/$p ]] && cp -f .devcarry/$p/model.* .devcarry/$p/*.gz "$STAGE/" 2>/dev/null
done
MODELS="${FMSERVE_CACHE:-$HOME/.cache/fmserve/models}"
if [[ -f $STAGE/model.part1 && -f $STAGE/model.part2 && -f $STAGE/model.part3 \
      && -f $STAGE/model.sha256 ]]; then
    mkdir -p "$MODELS"
    name="$(awk '{print $2}' "$STAGE/model.sha256")"
    if [[ ! -f $MODELS/$name ]]; then
        cat "$STAGE"/model.part1 "$STAGE"/model.part2 "$STAGE"/model.part3 > "$MODELS/$name"
        (cd "$MODELS" && sha256sum -c --quiet "$STAGE/model.sha256") \
            || { echo "stage: the joined model fails its checksum"; rm -f "$MODELS/$name"; exit 1; }
    fi
    echo "stage: model ready: $MODELS/$name"
else
    echo "stage: model pieces so far: $(cd "$STAGE" && ls model.part* 2>/dev/null | tr '\n' ' ')"
fi
SHARED="$(cd .. && pwd)/shared/data/prompts"
if compgen -G "$STAGE/*.jsonl.gz" > /dev/null; then
    mkdir -p "$SHARED"
    for f in "$STAGE"/*.jsonl.gz; do
        out="$SHARED/$(basename "$f" .gz)"
        [[ -f $out ]] || gunzip -c "$f" > "$out"
    done
fi

# step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, print the tail.
step() {
    local name=$1 secs=$2; shift 2
    echo "=== $name (limit ${secs}s): $*"
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
    return 0
}
