#!/usr/bin/env bash
# Data-parallel training on two GPUs against one (docs/training.md): trains the default pair's
# draft on 1 GPU and on 2 GPUs (torchrun, NCCL) with the same data (numpy, scipy and networkx
# sources), seed and global batch, kills the 2-GPU run after its first checkpoint and resumes it
# on 2 GPUs and on 1 GPU, then plots the held-out loss curves and prints tokens/s.
#   bash benchmarks/ddp.sh [--target DIR] [--out DIR] [--steps 300] [--every 50] [--batch 32]
#       [--resume-test 1|0] [--repeat 0|1] [--bench 0|1]
# --batch is the global batch (half per rank); --resume-test 0 skips the kill-and-resume runs;
# --repeat 1 trains on 2 GPUs twice (run-to-run noise next to the 1 vs 2 GPU difference);
# --bench 1 first times the trainer alone (bench_train.py) on 1 GPU and on 2 ranks.
# Results in DIR: ddp.log, metrics_<run>.jsonl, curves.png (and bench_ddp.log).
set -uo pipefail
KNOWN="target steps every batch resume_test repeat bench"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # torchrun would set 1
steps=${steps:-300}; every=${every:-50}; batch=${batch:-32}
if [ "${bench:-0}" = 1 ]; then
  { python3 benchmarks/bench_train.py --shape smollm2 --batch 8,16 --chunk 4096 --profile
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_train.py --shape smollm2 --batch 8,16 --chunk 4096 \
      --profile; } 2>&1 | grep -v "Warning\|warn(" | tee "$dest/bench_ddp.log"
fi
args="train --target $target --data $site/numpy $site/scipy $site/networkx --seq-len 2048 --steps $steps
      --lr 1e-3 --warmup 20 --eval-every $every --save-every $every --eval-chunks 32 --log-every 10 --no-progress
      --device cuda --dtype bfloat16 --seed 3 --data-cache $dest/tokens"
run1() { python3 -m longspec.cli $args --out "$1" --batch-size $batch "${@:2}"; }
run2() { torchrun --standalone --nproc_per_node 2 -m longspec.cli $args --out "$1" --batch-size $((batch / 2)) "${@:2}"; }
{
  echo "== 1 GPU"; run1 "$dest/one"
  echo "== 2 GPUs"; run2 "$dest/two"
  [ "${repeat:-0}" = 0 ] || { echo "== 2 GPUs again (run-to-run noise)"; run2 "$dest/two_b"; }
  if [ "${resume_test:-1}" = 1 ]; then
    echo "== 2 GPUs, killed after the first checkpoint"; run2 "$dest/killed" & pid=$!
    while [ ! -d "$dest/killed/checkpoints/step-$(printf %08d $every)" ] && kill -0 $pid 2>/dev/null; do sleep 1; done
    kill -9 $pid; pkill -9 -f -- "--out $dest/killed "; wait $pid
    cp -r "$dest/killed" "$dest/killed1"
    echo "== resumed on 2 GPUs"; run2 "$dest/killed" --resume
    echo "== resumed on 1 GPU"; run1 "$dest/killed1" --resume
  fi
} 2>&1 | tee "$dest/ddp.log"
for name in one two two_b killed killed1; do
  [ ! -f "$dest/$name/metrics.jsonl" ] || cp "$dest/$name/metrics.jsonl" "$dest/metrics_$name.jsonl"
done
python3 benchmarks/plot_ddp.py "$dest"
