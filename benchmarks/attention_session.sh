#!/usr/bin/env bash
# The hybrid tree-attention issue on nvidia-h200-x2, no model needed. GPU 0: the kernel's
# launch-parameter sweep (32k; M = 64, 69) and the op table (bench_attention.py: 8k-128k, the default
# with and without TMA). GPU 1 at the same time: the kernel's
# bf16 GPU tests, then the compiled 8B-shape decode and 69-token verify at 32k with each kernel
# variant (KERNELS: ';'-separated bench_steps --kernel options; an empty one = the default).
# Logs under $OUT: attention_sweep.log, attention.log, kernel_tests.log, steps_8b_kernels.log.
# The whole 8B step table: STEPS=steps8b bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 -m pytest -q -rfE -m gpu tests/test_tree_attention.py -p no:cacheprovider \
    > "$OUT/kernel_tests.log" 2>&1
  IFS=";" read -ra kernels <<< "${KERNELS-;tma=0}"
  for kernel in "${kernels[@]}"; do
    CUDA_VISIBLE_DEVICES=1 timeout ${STEP8B_TIMEOUT:-140} python3 benchmarks/bench_steps.py --shape llama-8b \
      --contexts 32768 --trees 69 --attention triton --compile on ${kernel:+--kernel $kernel} 2>&1 \
      | grep -v "Warning\|warn(\|crop\|rotary_emb"
  done > "$OUT/steps_8b_kernels.log"
} & gpu1=$!
CUDA_VISIBLE_DEVICES=0 STEPS="sweep attention" STEP_TIMEOUT=${GPU0_TIMEOUT:-240} bash benchmarks/gpu_session.sh 2>&1 \
  | grep -v "Warning\|warn(" | grep -v "OutOfResources"
wait $gpu1
tail -n 3 "$OUT/kernel_tests.log"; grep -v "^{" "$OUT/steps_8b_kernels.log"
