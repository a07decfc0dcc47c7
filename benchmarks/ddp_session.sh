#!/usr/bin/env bash
# Issue 11 on nvidia-h200-x2 (second call of a session, after part 00 of the default model was
# copied to /root/stage as for gpu_session.sh): trains the default pair's draft on 1 GPU and on 2
# GPUs (torchrun, NCCL) with the same data, seed and global batch, kills the 2-GPU run after its
# first checkpoint and resumes it on 2 GPUs and on 1 GPU, then plots the held-out loss curves and
# prints tokens/s. Results under $OUT (metrics_*.jsonl, curves.png, ddp.log). BENCH_DDP=1 first
# times and profiles the trainer alone on 1 GPU and on 2 ranks (bench_ddp.log); RESUME_TEST=0 skips
# the kill-and-resume runs; BATCH is the global batch (BATCH/2 per rank); REPEAT=1 runs the
# 2-GPU training twice (its run-to-run noise, next to the 1-GPU vs 2-GPU difference).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # torchrun would set 1
STEPS=${STEPS:-300}; EVERY=${EVERY:-50}; BATCH=${BATCH:-16}
if [ -n "${BENCH_DDP:-}" ]; then  # the trainer alone (random SmolLM2-shaped target): 1 GPU, then 2 ranks, profiled
  { python3 benchmarks/bench_train.py --shape smollm2 --batch ${BENCH_BATCH:-8,16} --chunk 4096 --profile
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_train.py --shape smollm2 --batch ${BENCH_BATCH:-8,16} \
      --chunk 4096 --profile; } 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/bench_ddp.log"
fi
STEPS="convert" bash benchmarks/gpu_session.sh >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$PWD
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ARGS="train --target /root/stage/smol-hf --data $SITE/numpy $SITE/scipy $SITE/networkx --seq-len 2048 --steps $STEPS
      --lr 1e-3 --warmup 20 --eval-every $EVERY --save-every $EVERY --eval-chunks 32 --log-every 10 --no-progress
      --device cuda --dtype bfloat16 --seed 3 --data-cache /root/stage/tokens"
run1() { timeout ${RUN_TIMEOUT:-170} python3 -m longspec.cli $ARGS --out "$1" --batch-size $BATCH "${@:2}"; }
run2() { timeout ${RUN_TIMEOUT:-170} torchrun --standalone --nproc_per_node 2 -m longspec.cli $ARGS --out "$1" --batch-size $((BATCH / 2)) "${@:2}"; }
{
  echo "== 1 GPU"; run1 /root/one
  echo "== 2 GPUs"; run2 /root/two
  [ -z "${REPEAT:-}" ] || { echo "== 2 GPUs again (run-to-run noise)"; run2 /root/two_b; }
  [ "${RESUME_TEST:-1}" = 1 ] || exit 0  # RESUME_TEST=0: throughput and curves only
  echo "== 2 GPUs, killed after the first checkpoint"; run2 /root/killed & pid=$!
  while [ ! -d /root/killed/checkpoints/step-$(printf %08d $EVERY) ] && kill -0 $pid 2>/dev/null; do sleep 1; done
  pkill -9 -f "out /root/killed" ; wait $pid
  cp -r /root/killed /root/killed1
  echo "== resumed on 2 GPUs"; run2 /root/killed --resume
  echo "== resumed on 1 GPU"; run1 /root/killed1 --resume
} 2>&1 | tee "$OUT/ddp.log"
for name in one two two_b killed killed1; do [ ! -f /root/$name/metrics.jsonl ] || cp /root/$name/metrics.jsonl "$OUT/metrics_$name.jsonl"; done
python3 benchmarks/plot_ddp.py "$OUT"
