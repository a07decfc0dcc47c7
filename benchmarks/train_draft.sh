#!/usr/bin/env bash
# How the shipped draft was made (docs/training.md), on a host with --gpus GPUs (default: all):
#   bash benchmarks/train_draft.sh [--target DIR] --out DIR [--phases "chats train export"]
#       [--steps 8000] [--batch 16] [--compile auto|on|off]
#       [--eval-packages "transformers httpx starlette rich"] [--gpus N]
# Phases (default: all three, in order):
#   chats   self-distillation data: `longspec self-distill` on every GPU (one shard each, same seed)
#           over the documents of the installed packages except the --eval-packages ones (kept for
#           evaluation; the standard library is refused anyway): DIR/chats.<i>.jsonl. Skipped when
#           they exist (the data, and so the sample order, must stay the same for a resumed run).
#   train   torchrun on the GPUs: every installed package except the --eval-packages ones, plus the chats,
#           with --distill (KL to the target on every token), global batch GPUs x --batch x 2048
#           tokens, --steps steps in all (the learning-rate schedule); DIR/run holds the run and
#           its checkpoints: run the phase again after a stop and it resumes from the newest one.
#   export  the trained draft in bf16 with its reduced vocabulary (the 8192 most frequent tokens of
#           numpy + networkx) and its acceptance table (httpx + starlette: held out), in
#           DIR/smollm2-draft: copy it over longspec/assets/smollm2-draft to ship it.
# On two H200s the train phase runs ~525k tokens/s (8000 steps: about 17 minutes).
set -uo pipefail
KNOWN="target phases steps batch compile eval_packages gpus"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
gpus=${gpus:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
eval_packages=${eval_packages:-"transformers httpx starlette rich"}
run=$dest/run
packages() {  # top-level package directories of site-packages, without the evaluation ones
  for p in "$site"/*/; do
    name=$(basename "$p")
    case " $eval_packages " in *" $name "*) continue ;; esac
    case $name in *.dist-info|*.egg-info|__pycache__) continue ;; esac
    echo "${p%/}"
  done
}
for phase in ${phases:-chats train export}; do
  case $phase in
    chats)
      if ! ls "$dest"/chats.*.jsonl >/dev/null 2>&1; then
        for ((i = 0; i < gpus; i++)); do
          python3 -m longspec.cli self-distill --target "$target" --docs $(packages) --out "$dest/chats.$i.jsonl" \
            --shard $i/$gpus --limit 6000 --batch 32 --device cuda:$i --seed 11 > "$dest/chats.$i.log" 2>&1 &
        done
        wait
        tail -n 2 "$dest"/chats.*.log; wc -l "$dest"/chats.*.jsonl
      fi ;;
    train)
      resume=""; [ -f "$run/checkpoints/latest" ] && resume="--resume"
      chats=$(for f in "$dest"/chats.*.jsonl; do [ -s "$f" ] && echo "$f"; done)
      torchrun --standalone --nproc_per_node "$gpus" -m longspec.cli train \
        --target "$target" --data "$site" $chats --exclude $eval_packages '*.dist-info' --out "$run" \
        --seq-len 2048 --batch-size ${batch:-16} --steps ${steps:-8000} --lr 1e-3 --warmup 200 --window 512 \
        --distill --compile ${compile:-auto} --eval-every 500 --save-every 250 --eval-chunks 64 --log-every 25 \
        --device cuda --dtype bfloat16 --no-progress --data-cache "$dest/tokens" $resume 2>&1 \
        | grep -v "Warning\|warn(" | tee -a "$dest/train.log" ;;
    export)  # from the newest checkpoint
      python3 -m longspec.cli draft-vocab --target "$target" --draft "$run/checkpoints/$(cat "$run/checkpoints/latest")" \
        --data "$site/numpy" "$site/networkx" --size 8192 --out "$dest/smollm2-draft" 2>&1 | tail -2
      python3 benchmarks/draft_acceptance.py --target "$target" --draft "$dest/smollm2-draft" \
        --data "$site/httpx" "$site/starlette" --write 2>&1 | tail -8
      python3 - "$target" "$dest/smollm2-draft" <<'PY'
import sys, torch
from longspec import load_target, load_draft, save_draft
target = load_target(sys.argv[1], dtype=torch.bfloat16, device="cuda")
save_draft(load_draft(sys.argv[2], target), sys.argv[2])  # bf16, as shipped
print("exported", sys.argv[2])
PY
      cp "$run/metrics.jsonl" "$dest/smollm2-draft/" ;;
    *) echo "unknown phase $phase (see --help)" >&2; exit 2 ;;
  esac
done
