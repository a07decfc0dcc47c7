#!/usr/bin/env bash
# The tau table of docs/training.md ("Draft quality"): every proposer on held-out text, code (a
# package the draft never saw: transformers/generation) and prose (a chat request to summarise the
# standard library's language reference), at 2k / 4k / 7.9k tokens, greedy and T=1. Accuracy only
# (tau does not depend on the device's speed; float32 by default): on a CPU one cell after another,
# on GPUs --jobs cells at a time spread over --gpus (indices, space-separated). JSON lines to
# --log in cell order (also the cells finished when the script is stopped), then the plot
# (--plot); exits non-zero if a cell failed (its output is in the log).
#   bash benchmarks/tau_table.sh [--target DIR] [--draft DIR] [--log FILE] [--plot FILE.png]
#       [--settings "pld chain:10;hybrid 4,16,16,16,16"] [--temps "0 1"] [--lengths "2048 4096 7900"]
#       [--gpus "0 1"] [--jobs 8] [--dtype float32]
#   bash benchmarks/tau_table.sh                                       # ~1 h on 2 CPU cores
#   bash benchmarks/tau_table.sh --gpus "0 1" --jobs 8 --log tau.log --plot tau.png   # ~3 min on 2 H200
set -uo pipefail
KNOWN="target draft log plot settings temps lengths gpus jobs dtype"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
LOG=${log:-benchmarks/results/tau_table_cpu.log}
SITE=$site
SETTINGS=${settings:-"pld chain:10;streaming chain:4;longspec 4,16,16,16,16;hybrid 4,16,16,16,16,1,1,1,1,1"}
read -r -a gpus <<< "${gpus:-}"
JOBS=${jobs:-1}
[ "$JOBS" -ge 1 ] 2>/dev/null || { echo "--jobs must be a positive integer, got $JOBS" >&2; exit 2; }
cells=$(mktemp -d)
collect() { cat "$cells"/* 2>/dev/null | grep -v Warning > "$LOG"; rm -rf "$cells"; }
trap collect EXIT
i=0
for temp in ${temps:-0 1}; do
  for length in ${lengths:-2048 4096 7900}; do
    for text in code prose; do
      name=$(printf "%s/%03d" "$cells" $i)
      device=""; [ ${#gpus[@]} -gt 0 ] && device="--device cuda:${gpus[$((i % ${#gpus[@]}))]}"
      { python3 benchmarks/tau_trees.py --text $text --prompt-dir "$SITE/transformers/generation" --length $length \
          --temperature $temp --settings "$SETTINGS" --dtype ${dtype:-float32} $device --target "$target" --draft "$draft" 2>&1 \
          || echo "FAILED: $text $length T=$temp (exit $?)"; } > "$name" &
      i=$((i + 1))
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    done
  done
done
wait
trap - EXIT
collect
cat "$LOG"
python3 benchmarks/plot_tau.py "$LOG" "${plot:-benchmarks/results/tau_table.png}"
! grep -q "^FAILED" "$LOG"
