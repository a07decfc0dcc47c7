#!/usr/bin/env bash
# The GPU tests (pytest -m gpu), split over two GPUs where the host has them (about half the time
# of one): GPU 1 runs test_gpu.py but its compiled and sampling tests (with GPU 0 as its second
# device, for the two-GPU test), GPU 0 those and the bf16 kernel tests. On one GPU: all in turn
# (about 25 minutes on an H100), or one of four parts of under 10 minutes each (--part 1..4):
#   1: parity with transformers, greedy losslessness, compiled steps, sampling with graphs, one
#      host sync a round;  2: batch buckets, captures, chunked prefill, steady state;
#   3: auto's, the compiled causal attention, top-k / top-p, the prefix cache;
#   4: past 2^31 cache elements and 256k tokens, the tree attention's kernels.
# Each part's slowest tests are listed at its end (--durations), and a part past its time limit
# (--limit seconds, default 570) still prints its summary. --workers N runs a part's tests in N
# processes on the one GPU (pytest-xdist; most of a test's time is compiling, on the host's CPUs).
#   bash benchmarks/gpu_tests.sh [--out DIR] [--part N] [--limit S] [--workers N]
# Logs in DIR: gpu_tests_a.log, gpu_tests_b.log (gpu_tests_partN.log for a part).
set -uo pipefail
KNOWN="part limit workers"
part=""
limit=570
workers=1
source "$(dirname "$0")/_args.sh"
parse_args "$@"
pytest_gpu() {
  local spread=()
  [ "$workers" -gt 1 ] && spread=(-n "$workers")
  timeout -s INT "$limit" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --durations=10 "${spread[@]}" "$@"
}
if [ -n "$part" ]; then
  case $part in
    1) pytest_gpu tests/test_gpu.py -k "parity or lossless or second_gpu or compiled_steps or sampling_with or host_sync" ;;
    2) pytest_gpu tests/test_gpu.py -k "(buckets or capture or destroyed or chunked_prefill or steady_state) and not auto" ;;
    3) pytest_gpu tests/test_gpu.py tests/test_prefix_cache.py \
         -k "auto or lower_right or select_top or warping or prefix_cache" ;;
    4) pytest_gpu tests/test_long_context.py tests/test_tree_attention.py ;;
    *) echo "--part is 1, 2, 3 or 4" >&2; exit 2 ;;
  esac 2>&1 | tee "$dest/gpu_tests_part$part.log"
  exit
fi
if [ "$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)" -lt 2 ]; then
  python3 -m pytest -q -rfE -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$dest/gpu_tests_a.log"; exit
fi
CUDA_VISIBLE_DEVICES=1,0 python3 -m pytest -q -rfE -m gpu tests/test_gpu.py -k "not compiled and not sampling" \
  -p no:cacheprovider > "$dest/gpu_tests_a.log" 2>&1 & a=$!
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -rfE -m gpu tests/test_tree_attention.py tests/test_gpu.py \
  -k "compiled or sampling or bfloat16" -p no:cacheprovider > "$dest/gpu_tests_b.log" 2>&1
wait $a
tail -n 15 "$dest/gpu_tests_a.log" "$dest/gpu_tests_b.log"
