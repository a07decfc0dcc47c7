#!/usr/bin/env bash
# The tau table of README "Draft quality": every proposer on held-out text, code (a package the
# draft never saw) and prose (a chat request to summarise the standard library's language
# reference), at 2k / 4k / 7.9k tokens, greedy and T=1. Accuracy only (tau does not depend on
# the device's speed; float32 by default): on a CPU one cell after another, on GPUs JOBS cells at
# a time spread over the GPUs (GPUS: their indices, space-separated). JSON lines to $LOG in cell
# order (also the cells finished when the script is stopped), then the plot; exits non-zero if
# a cell failed (its output is in $LOG).
#   bash benchmarks/tau_table.sh                                   # ~1 h on 2 CPU cores
#   GPUS="0 1" JOBS=8 LOG=$OUT/tau.log PLOT=$OUT/tau.png bash benchmarks/tau_table.sh   # ~3 min on 2 H200
set -uo pipefail
LOG=${LOG:-benchmarks/results/tau_table_cpu.log}
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SETTINGS=${SETTINGS:-"pld chain:10;streaming chain:4;longspec 4,16,16,16,16;hybrid 4,16,16,16,16,1,1,1,1,1"}
read -r -a gpus <<< "${GPUS:-}"
JOBS=${JOBS:-1}
[ "$JOBS" -ge 1 ] 2>/dev/null || { echo "JOBS must be a positive integer, got $JOBS" >&2; exit 2; }
cells=$(mktemp -d)
collect() { cat "$cells"/* 2>/dev/null | grep -v Warning > "$LOG"; rm -rf "$cells"; }
trap collect EXIT
i=0
for temp in ${TEMPS:-0 1}; do
  for length in ${LENGTHS:-2048 4096 7900}; do
    for text in code prose; do
      name=$(printf "%s/%03d" "$cells" $i)
      device=""; [ ${#gpus[@]} -gt 0 ] && device="--device cuda:${gpus[$((i % ${#gpus[@]}))]}"
      { python3 benchmarks/tau_trees.py --text $text --prompt-dir "$SITE/transformers/generation" --length $length \
          --temperature $temp --settings "$SETTINGS" --dtype ${DTYPE:-float32} $device ${TAU_ARGS:-} 2>&1 \
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
python3 benchmarks/plot_tau.py "$LOG" "${PLOT:-benchmarks/results/tau_table.png}"
! grep -q "^FAILED" "$LOG"
