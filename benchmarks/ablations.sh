#!/usr/bin/env bash
# The ablations of docs/training.md: drafts for the default model trained with the same data
# (numpy, scipy and networkx sources), seed and steps, spread over the host's GPUs — by default the
# recipe (anchor-offset positions + noisy lags), without noisy lags, without anchor offsets, with
# distillation, and with a 3x wider MLP — then benchmarks/ablations.py compares them on held-out
# packages (acceptance per depth, predicted tokens per round, the reduced vocabulary) and plots
# the held-out loss.
#   bash benchmarks/ablations.sh [--target DIR] [--out DIR] [--steps 1500] [--every 250] [--batch 16]
#       [--runs "base;no-noise --no-noise;..."] [--gpus "0 1"] [--vocab 8192]
# --runs: ';'-separated "name [train options]" (the first is the baseline of the comparison).
# Results in DIR: ablations.log, ablations.png, metrics_<run>.jsonl. A 1500-step draft (49M
# tokens) trains in about 3 minutes on an H200 (compiled, ~530k tokens/s).
set -uo pipefail
KNOWN="target steps every batch runs gpus vocab"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
steps=${steps:-1500}; every=${every:-250}; batch=${batch:-16}
data="$site/numpy $site/scipy $site/networkx"
heldout=""; for p in requests click rich httpx starlette pydantic jinja2 yaml urllib3 setuptools; do
  [ -d "$site/$p" ] && heldout="$heldout $site/$p"; done
train() { python3 -m longspec.cli train --target "$target" --data $data --out "$dest/$1" --seq-len 2048 \
  --batch-size $batch --steps $steps --lr 1e-3 --warmup 20 --eval-every $every --save-every $every \
  --eval-chunks 32 --log-every 25 --no-progress --device cuda --dtype bfloat16 --seed 5 \
  --data-cache "$dest/data-cache" "${@:2}"; }
IFS=';' read -r -a given <<< "${runs:-base;no-noise --no-noise;no-anchor --no-anchor-offset;distill --distill;wide --intermediate-size 4608}"
all=(); for r in "${given[@]}"; do [ -n "${r// }" ] && all+=("$r"); done  # empty entries skipped
read -r -a gpu_list <<< "${gpus:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')}"
[ ${#gpu_list[@]} -ge 1 ] || gpu_list=(0)
for ((g = 0; g < ${#gpu_list[@]}; g++)); do  # the g-th GPU trains runs g, g + #GPUs, ... one after another
  ( for ((i = g; i < ${#all[@]}; i += ${#gpu_list[@]})); do
      set -- ${all[$i]}
      CUDA_VISIBLE_DEVICES=${gpu_list[$g]} train "$@" > "$dest/$1.log" 2>&1
      cp "$dest/$1/metrics.jsonl" "$dest/metrics_$1.jsonl" 2>/dev/null
    done ) &
done
wait
names=(); for r in "${all[@]}"; do set -- $r; names+=("$1=$dest/$1"); done
{
  for r in "${all[@]}"; do set -- $r; echo "== $1"; grep -v "Warning\|warn(" "$dest/$1.log" | tail -3; done
  python3 benchmarks/ablations.py --target "$target" --heldout $heldout --vocab ${vocab:-8192} \
    --vocab-data $data --runs "${names[@]}" --out "$dest"
} 2>&1 | tee "$dest/ablations.log"
