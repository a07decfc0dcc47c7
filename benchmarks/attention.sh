#!/usr/bin/env bash
# The hybrid tree-attention measurements of docs/benchmarks.md (no model needed), on a host with
# two GPUs. GPU 0: the kernel's launch-parameter sweep (32k; M = 64, 69) and the op table
# (bench_attention.py, 8k-128k). GPU 1 at the same time: the kernel's bf16 GPU tests, then the
# compiled 8B-shape decode and 69-token verify at 32k with each kernel variant.
#   bash benchmarks/attention.sh [--out DIR] [--kernels ";tma=0"]
# --kernels: ';'-separated bench_steps.py --kernel options (an empty one = the default kernel).
# Logs in DIR: attention_sweep.log, attention.log, kernel_tests.log, steps_8b_kernels.log.
set -uo pipefail
KNOWN="kernels"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
{
  CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -rfE -m gpu tests/test_tree_attention.py -p no:cacheprovider \
    > "$dest/kernel_tests.log" 2>&1
  IFS=";" read -ra variants <<< "${kernels-;tma=0}"
  for kernel in "${variants[@]}"; do
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768 --trees 69 \
      --attention triton --compile on ${kernel:+--kernel $kernel} 2>&1 | grep -v "Warning\|warn(\|crop\|rotary_emb"
  done > "$dest/steps_8b_kernels.log"
} & gpu1=$!
CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_benchmarks.sh --out "$dest" --steps "sweep attention" 2>&1 \
  | grep -v "Warning\|warn(\|OutOfResources"
wait $gpu1
tail -n 3 "$dest/kernel_tests.log"; grep -v "^{" "$dest/steps_8b_kernels.log"
