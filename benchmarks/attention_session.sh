#!/usr/bin/env bash
# The hybrid tree-attention issue on nvidia-h200-x2, no model needed: GPU 0 runs the kernel's
# launch-parameter sweep and the op table (bench_attention.py), GPU 1 at the same time the GPU
# tests (GPU 0 second: the two-GPU test) and the 8B-shape step table (bench_steps.py --shape
# llama-8b). Logs under $OUT:
# attention_sweep.log, attention.log, gpu_tests.log, steps_8b.log. On one GPU, run the same
# steps one after the other: STEPS="sweep attention tests steps8b" bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CUDA_VISIBLE_DEVICES=1,0 STEPS="tests steps8b" ATTENTION_8B=${ATTENTION_8B:-triton} STEP_TIMEOUT=${GPU1_TIMEOUT:-300} bash benchmarks/gpu_session.sh \
  > "$OUT/gpu1.log" 2>&1 & gpu1=$!
CUDA_VISIBLE_DEVICES=0 STEPS="sweep attention" STEP_TIMEOUT=${GPU0_TIMEOUT:-260} bash benchmarks/gpu_session.sh 2>&1 \
  | grep -v "Warning\|warn(" | grep -v "OutOfResources"
wait $gpu1
tail -n 5 "$OUT/gpu_tests.log"; grep -v "^{" "$OUT/steps_8b.log" | tail -n 30
