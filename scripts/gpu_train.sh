#!/usr/bin/env bash
# Regenerates training responses with the target on a GPU and trains the drafter on them, from a bare checkout on
# the project's GPU machine (one H200; no package registry there, at most 64 MiB travels per call), in one call of
# under 9 minutes once everything it needs is there (the step time limits add up to 520 s; checkpoints every 200
# steps, so a train step stopped at its limit still exports the last one).
#
# What cannot travel with the checkout in one call is staged here, under $STAGE (default .gl/gpu_train, ignored
# by git), by
#     scripts/gpu_train.sh stage
# : the target's GGUF (98 MB) in parts sized to fit beside the working tree ($STAGE/part-K), and in
# $STAGE/common its sha256, the prompt set (xz) and the `gguf` wheel. Then the SAME command runs there once per
# part, each call carrying $STAGE/common and the next part, back to back (the machine keeps what earlier calls
# brought while it stays warm): until every part is there a call only reports which are missing (exit 0,
# $OUT_DIR/summary.json); the call that completes them joins the GGUF, checks its sha256 and runs the steps:
#   regenerate  responses for 200 s (prompts not in data/responses; greedy 3 : 1 sampled)
#   train       for 150 s on data/responses + the new responses, warm-started from the shipped drafter
#   export      the bf16 drafter with its model card and learning curve
# Results: $OUT_DIR/summary.json and $OUT_DIR/result.tar.partNN (15 MiB each: the new response shards, the
# exported drafter and the training history), unpacked here by
#     cat result.tar.part* | tar -x -C runs/gpu_train
# Usage: [CHECK_DEVICE=cuda|xpu|cpu] [CHECK_SIZE=full|tiny] [OUT_DIR=dir] [STAGE=dir] scripts/gpu_train.sh [stage]
#   CHECK_DEVICE defaults to cuda; OUT_DIR to $OUT, then runs/gpu_train. CHECK_SIZE=tiny: 8 prompts of 16 tokens,
#   3 training steps (CI's dry run on cpu: tests/test_gpu_train.py). Staging: PART_MB sets the part size (default:
#   what fits beside the working tree), PROMPTS the prompt set (default data/prompts.jsonl, scripts/build_prompts.py),
#   STAGE_WHEELS=0 skips the wheel download.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
DEVICE=${CHECK_DEVICE:-cuda}
SIZE=${CHECK_SIZE:-full}
STAGE=${STAGE:-.gl/gpu_train}
mkdir -p "$STAGE" && STAGE=$(cd "$STAGE" && pwd -P)
MIB=$((1 << 20))

if [[ ${1:-} == stage ]]; then
    rm -rf "$STAGE/common" "$STAGE"/part-* && mkdir -p "$STAGE/common"
    gguf=$(python -c 'from sglang_dflash.models.default_model import default_model_path; print(default_model_path())') \
        || exit 1
    xz -T2 -c "${PROMPTS:-data/prompts.jsonl}" >"$STAGE/common/prompts.jsonl.xz" || exit 1
    if [[ ${STAGE_WHEELS:-1} != 0 ]]; then
        python -m pip download -q --no-deps --only-binary=:all: -d "$STAGE/common" \
            "gguf==$(python -c 'from importlib.metadata import version; print(version("gguf"))')" || exit 1
    fi
    tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
    common=$(du -sb "$STAGE/common" | cut -f1)
    part=$((${PART_MB:-0} * MIB))
    ((part > 0)) || part=$((63 * MIB - tree - common))
    ((part >= 8 * MIB)) || { echo "the working tree ($((tree / MIB)) MiB) leaves no room for a part" >&2; exit 1; }
    split -b "$part" -d -a 2 "$gguf" "$STAGE/target.gguf." || exit 1
    n=0
    for piece in "$STAGE"/target.gguf.[0-9][0-9]; do
        n=$((n + 1))
        mkdir "$STAGE/part-$n" && mv "$piece" "$STAGE/part-$n/"
    done
    ((n > 0)) || { echo "split wrote no parts" >&2; exit 1; }
    printf '{"file": "%s", "sha256": "%s", "parts": %d}\n' "$(basename "$gguf")" \
        "$(sha256sum "$gguf" | cut -d' ' -f1)" "$n" >"$STAGE/common/target.json"
    echo "staged $(basename "$gguf") in $n parts of $((part / MIB)) MiB beside a $((tree / MIB)) MiB working tree;"
    echo "run scripts/gpu_train.sh there $n times, back to back, carrying ${STAGE#"$ROOT"/}/common and:"
    for ((k = 1; k <= n; k++)); do echo "  call $k: ${STAGE#"$ROOT"/}/part-$k"; done
    exit 0
fi

OUT_DIR=${OUT_DIR:-${OUT:-runs/gpu_train}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd -P)
summary() {  # summary JSON_FIELDS: writes $OUT_DIR/summary.json
    printf '{"device": "%s", "size": "%s", %s}\n' "$DEVICE" "$SIZE" "$1" >"$OUT_DIR/summary.json"
    cat "$OUT_DIR/summary.json"
}
fail() {  # fail MESSAGE: the reason in summary.json too, exit 1
    echo "$1" >&2
    summary "\"ok\": false, \"error\": \"$1\""
    exit 1
}
[[ -f $STAGE/common/target.json ]] || fail "nothing staged in $STAGE: run scripts/gpu_train.sh stage here"
read -r name sha parts < <(python -c 'import json, sys; t = json.load(open(sys.argv[1]))
print(t["file"], t["sha256"], t["parts"])' "$STAGE/common/target.json")
missing=()
for ((k = 1; k <= parts; k++)); do
    compgen -G "$STAGE/part-$k/target.gguf.*" >/dev/null || missing+=("$k")
done
if ((${#missing[@]})); then
    echo "parts here: $((parts - ${#missing[@]})) of $parts; still to carry: ${missing[*]}"
    summary "\"parts\": $parts, \"missing\": [$(IFS=,; echo "${missing[*]}")]"
    exit 0
fi
GGUF=$STAGE/$name
if [[ ! -f $GGUF ]] || [[ $(sha256sum "$GGUF" | cut -d' ' -f1) != "$sha" ]]; then
    for ((k = 1; k <= parts; k++)); do cat "$STAGE/part-$k"/target.gguf.*; done >"$GGUF.tmp"
    [[ $(sha256sum "$GGUF.tmp" | cut -d' ' -f1) == "$sha" ]] || fail "joined $name: sha256 mismatch"
    mv "$GGUF.tmp" "$GGUF"
fi
if ! python -c 'import gguf' 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$STAGE/site" \
        "$STAGE"/common/*.whl || fail "installing the staged wheels failed"
    export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export SGLANG_DFLASH_CACHE=$STAGE/cache  # the converted GGUF outlives this call (while the machine stays up)
unset TRITON_INTERPRET SGLANG_DFLASH_KERNELS
source "$ROOT/scripts/bare_checkout.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$PKG_ROOT" "$WORK"' EXIT  # bare_checkout.sh's trap, and the work dir
python -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$STAGE/common/prompts.jsonl.xz" "$WORK/prompts.jsonl" || fail "unpacking the prompts failed"

if [[ $SIZE == tiny ]]; then
    regen=(--num-prompts 8 --max-new-tokens 16 --max-running-requests 4)
    train=(--total-steps 3 --seqs-per-step 2 --anchors-per-seq 4 --max-len 128 --dev-size 2 --eval-every 3 --labels soft)
elif [[ $SIZE == full ]]; then
    regen=(--num-prompts 1000000 --max-new-tokens 512 --max-running-requests 256 --time-budget-s 200
           --skip-done-in "$ROOT/data/responses")
    train=(--total-steps 100000 --time-budget-s 150 --seqs-per-step 16 --anchors-per-seq 256 --lr 6e-4
           --eval-every 500 --ckpt-every 200 --labels soft)  # soft labels: +0.03 tau in a 300-step CPU pair
else
    fail "CHECK_SIZE must be full or tiny, got '$SIZE'"
fi

status=0
steps=()
step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2 start=$SECONDS rc result=ok
    shift 2
    echo "=== $name"
    timeout -k 5 "$limit" "$@"
    rc=$?
    if ((rc == 124 || rc == 137)); then
        result=timeout
    elif ((rc != 0)); then
        result=failed
    fi
    ((rc == 0)) || status=1
    echo "=== $name: $result rc=$rc ($((SECONDS - start)) s)"
    steps+=("{\"name\": \"$name\", \"status\": \"$result\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}")
}

step regenerate 270 python "$ROOT/scripts/generate_responses.py" --device "$DEVICE" --model-path "$GGUF" \
    --prompts "$WORK/prompts.jsonl" --out "$WORK/responses" --shard-size 2048 --stats "$WORK/regenerate.json" "${regen[@]}"
step train 210 python "$ROOT/scripts/train_dflash.py" --device "$DEVICE" --model-path "$GGUF" \
    --data "$ROOT/data/responses" "$WORK/responses" --out "$WORK/train" --eval-worker-prompts 0 \
    --init-from "$ROOT/sglang_dflash/drafters/smollm2-135m-instruct-dflash" "${train[@]}"
step export 40 python "$ROOT/scripts/export_drafter.py" --run "$WORK/train" --out "$WORK/drafter"

cp "$WORK/train/history.jsonl" "$WORK/drafter/" 2>/dev/null
(cd "$WORK" && tar -cf - --ignore-failed-read responses drafter) |
    split -b $((15 * MIB)) -d -a 2 - "$OUT_DIR/result.tar.part"
result_parts=$(compgen -G "$OUT_DIR/result.tar.part*" | wc -l)
if ((result_parts > 4)); then  # the device returns at most 8 files, 64 MiB in all
    echo "the result needs $result_parts parts of 15 MiB: more than come back" >&2
    status=1
fi
regenerated=$(cat "$WORK/regenerate.json" 2>/dev/null || echo null)
last=$(tail -n 1 "$WORK/train/history.jsonl" 2>/dev/null || echo null)
summary "\"ok\": $([[ $status == 0 ]] && echo true || echo false), \"steps\": [$(IFS=,; echo "${steps[*]}")],
 \"result_parts\": $result_parts, \"regenerate\": $regenerated, \"last_evaluation\": $last"
exit $status
