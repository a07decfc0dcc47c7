#!/usr/bin/env bash
# Issue 10's ablations (second call of a session, the default model staged as for
# gpu_session.sh), the runs spread over the host's GPUs (two at a time on nvidia-h200-x2): five
# drafts for the default model with the same data, seed and steps — the recipe (anchor-offset
# positions + noisy lags), without anchor offsets, without noisy lags, with distillation, and
# with a 3x wider MLP (--intermediate-size 4608); RUNS picks others (';'-separated), GPUS the GPUs
# (space-separated indices) — then benchmarks/ablations.py compares them on held-out packages (acceptance
# per depth, predicted tokens per round, the reduced vocabulary) and plots the held-out loss.
# Results under $OUT (ablations.log, ablations.png, metrics_*.jsonl). Training compiles (the CUDA
# default: ~537k tokens/s per H200, 486k with --distill), so a 2500-step draft (82M tokens) takes
# ~3.5 minutes; on x2 (three runs on one GPU) 1500-step drafts (49M tokens) fit one 600-s call:
#   STEPS=1500 EVERY=250 RUN_TIMEOUT=170 bash benchmarks/ablation_session.sh
# A run cut by RUN_TIMEOUT keeps its checkpoint of the last EVERY steps.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-400}; EVERY=${EVERY:-50}; BATCH=${BATCH:-16}
STEPS="convert" bash benchmarks/gpu_session.sh >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$PWD
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DATA="$SITE/numpy $SITE/scipy $SITE/networkx"
HELDOUT=""; for p in requests click rich httpx starlette pydantic jinja2 yaml urllib3 setuptools; do
  [ -d "$SITE/$p" ] && HELDOUT="$HELDOUT $SITE/$p"; done
train() { timeout ${RUN_TIMEOUT:-240} python3 -m longspec.cli train --target /root/stage/smol-hf --data $DATA \
  --out "/root/abl/$1" --seq-len 2048 --batch-size $BATCH --steps $STEPS --lr 1e-3 --warmup 20 \
  --eval-every $EVERY --save-every $EVERY --eval-chunks 32 --log-every 25 --no-progress --device cuda \
  --dtype bfloat16 --seed 5 --data-cache /root/abl/data-cache "${@:2}"; }
# RUNS: ';'-separated "name [train options]" (the first is the baseline of the comparison)
IFS=';' read -r -a given <<< "${RUNS:-base;no-noise --no-noise;no-anchor --no-anchor-offset;distill --distill;wide --intermediate-size 4608}"
RUNS=(); for run in "${given[@]}"; do [ -n "${run// }" ] && RUNS+=("$run"); done  # empty entries skipped
read -r -a gpus <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}"
[ ${#gpus[@]} -ge 1 ] || gpus=(0)
mkdir -p /root/abl
for ((g = 0; g < ${#gpus[@]}; g++)); do  # the g-th GPU trains runs g, g + #GPUs, ... one after another
  ( for ((i = g; i < ${#RUNS[@]}; i += ${#gpus[@]})); do
      set -- ${RUNS[$i]}
      CUDA_VISIBLE_DEVICES=${gpus[$g]} train "$@" > "/root/abl/$1.log" 2>&1
      cp "/root/abl/$1/metrics.jsonl" "$OUT/metrics_$1.jsonl" 2>/dev/null
    done ) &
done
wait
names=(); for run in "${RUNS[@]}"; do set -- $run; names+=("$1=/root/abl/$1"); done
{
  for run in "${RUNS[@]}"; do set -- $run; echo "== $1"; grep -v "Warning\|warn(" "/root/abl/$1.log" | tail -3; done
  python3 benchmarks/ablations.py --target /root/stage/smol-hf --heldout $HELDOUT --vocab ${VOCAB:-8192} \
    --vocab-data $DATA --runs "${names[@]}" --out "$OUT"
} 2>&1 | tee "$OUT/ablations.log"
