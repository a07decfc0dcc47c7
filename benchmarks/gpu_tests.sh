#!/usr/bin/env bash
# The GPU tests (pytest -m gpu), split over two GPUs where the host has them (about half the time
# of one): GPU 1 runs test_gpu.py but its compiled and sampling tests (with GPU 0 as its second
# device, for the two-GPU test), GPU 0 those and the bf16 kernel tests. On one GPU: all in turn.
#   bash benchmarks/gpu_tests.sh [--out DIR]
# Logs in DIR: gpu_tests_a.log, gpu_tests_b.log.
set -uo pipefail
KNOWN=""
source "$(dirname "$0")/_args.sh"
parse_args "$@"
if [ "$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)" -lt 2 ]; then
  python3 -m pytest -q -rfE -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$dest/gpu_tests_a.log"; exit
fi
CUDA_VISIBLE_DEVICES=1,0 python3 -m pytest -q -rfE -m gpu tests/test_gpu.py -k "not compiled and not sampling" \
  -p no:cacheprovider > "$dest/gpu_tests_a.log" 2>&1 & a=$!
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -rfE -m gpu tests/test_tree_attention.py tests/test_gpu.py \
  -k "compiled or sampling or bfloat16" -p no:cacheprovider > "$dest/gpu_tests_b.log" 2>&1
wait $a
tail -n 15 "$dest/gpu_tests_a.log" "$dest/gpu_tests_b.log"
