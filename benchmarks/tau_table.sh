#!/usr/bin/env bash
# The tau table of README "Draft quality": every proposer on held-out text, code (a package the
# draft never saw) and prose (a chat request to summarise the standard library's language
# reference), at 2k / 4k / 7.9k tokens, greedy and T=1. Accuracy only (tau does not depend on
# the device), so it runs on a CPU (float32). JSON lines to $LOG, then the plot.
#   bash benchmarks/tau_table.sh            # ~1 h on 2 CPU cores
set -uo pipefail
LOG=${LOG:-benchmarks/results/tau_table_cpu.log}
SITE=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
SETTINGS=${SETTINGS:-"pld chain:10;streaming chain:4;longspec 4,16,16,16,16;hybrid 4,16,16,16,16,1,1,1,1,1"}
: > "$LOG"
for temp in ${TEMPS:-0 1}; do
  for length in ${LENGTHS:-2048 4096 7900}; do
    for text in code prose; do
      python benchmarks/tau_trees.py --text $text --prompt-dir "$SITE/transformers/generation" --length $length \
        --temperature $temp --settings "$SETTINGS" 2>&1 | grep -v Warning | tee -a "$LOG"
    done
  done
done
python benchmarks/plot_tau.py "$LOG" "${PLOT:-benchmarks/results/tau_table.png}"
