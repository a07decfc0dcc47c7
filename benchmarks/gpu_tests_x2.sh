#!/usr/bin/env bash
# The GPU tests (-m gpu) split over the two GPUs of nvidia-h200-x2 (about half the time of one
# GPU): GPU 1 runs test_gpu.py but its compiled and sampling tests (GPU 0 as its second device,
# for the two-GPU test), GPU 0 those and the bf16 kernel tests, then AFTER (a command, e.g. a
# benchmark) on GPU 0. Logs: $OUT/gpu_tests_a.log, gpu_tests_b.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T=${TEST_TIMEOUT:-330}
CUDA_VISIBLE_DEVICES=1,0 timeout $T python3 -m pytest -q -rfE -m gpu tests/test_gpu.py -k "not compiled and not sampling" \
  -p no:cacheprovider > "$OUT/gpu_tests_a.log" 2>&1 & a=$!
CUDA_VISIBLE_DEVICES=0 timeout $T python3 -m pytest -q -rfE -m gpu tests/test_tree_attention.py tests/test_gpu.py \
  -k "compiled or sampling or bfloat16" -p no:cacheprovider > "$OUT/gpu_tests_b.log" 2>&1
[ -z "${AFTER:-}" ] || CUDA_VISIBLE_DEVICES=0 bash -c "$AFTER"
wait $a
tail -n 15 "$OUT/gpu_tests_a.log" "$OUT/gpu_tests_b.log"
