#!/usr/bin/env bash
# The warp-specialized Hopper tree attention kernel (attention/hopper_tree.py) on one Hopper GPU, no
# model needed, in calls of under 10 minutes each (--parts):
#   tests,forms,steps (the default): its GPU tests (outputs against the float64 reference; a
#     deadlock shows as the time limit); the forms named by --forms (default: the default form;
#     "two consumers", heads of 64 without the third consumer; "three free", three without turns)
#     against the Triton kernel alone (bench_hopper_tree.py: the 8B shape at 32k and 128k keys,
#     heads of 64 at 128k and 1M); whole compiled steps of an 8B-shaped target at 32k and 128k
#     without and with it (bench_steps.py --no-prefill --kernel hopper=0|1).
#   rounds,long: the 8B target's rounds with a random draft; a 1B-shaped target's decode and
#     verify steps at 1M keys without and with it; a long prefill's causal attention at heads of
#     64 and 128, and at heads of 64 over 1M keys, whole and in chunks of queries (bench_causal.py).
#   batch: the 8B target's steps for 4 rows of 32k keys without and with it.
#   sizes: by tree size (the tree's packed rows against the kernels' row tiles: the Triton kernel's
#     of 128 rows at heads of 128, this kernel's consumers of 64): the prefix part alone at the 8B
#     shape and at heads of 64 over 1M keys, the 1B-shaped target's verify steps at 1M keys, and
#     cuDNN's rate at heads of 128 for 16k queries over 128k keys (a long prefill's chunk).
#   tail: the kernel's masked blocks (the keys after a row's whole blocks, then the tree's): its
#     tests and the launch's on the GPU and its compiled forms' (about 6 minutes, mostly compiling;
#     stops at a failure or past 420 s, with the summary).
#   tail-timing: the tree attention at the 8B shape (32k, 128k) and heads of 64 over 1M keys, the
#     8B and 1B steps.
#   profile: the kernels of the 1B-shaped target's eager decode and verify steps at 1M keys with
#     it (bench_steps.py --profile): where a 69-node verify's time goes at heads of 64.
#   bash benchmarks/hopper_tree.sh [--out DIR] [--forms "default,two consumers"] [--parts P]
# Logs in DIR: hopper_tests.log, hopper_forms.log, steps_8b_hopper.log, rounds_8b_hopper.log,
# steps_1b_1m_hopper.log, causal_by_head_dim.log, steps_8b_batch4_hopper.log, steps_1b_1m_profile.log,
# hopper_by_tree_size.log, steps_1b_1m_by_tree.log, tail_in_kernel_tests.log,
# tail_in_kernel_forms.log, tail_in_kernel_steps.log.
set -uo pipefail
KNOWN="forms parts"
forms="default,two consumers,three free"
parts="tests,forms,steps"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
quiet="Warning\|warn(\|^{\|softmax\|^$"
# LIMIT BENCH_STEPS_ARGS..: compiled steps, the Triton kernel alone, then with the Hopper kernel
steps_without_and_with() {
  local limit=$1 kernel
  shift
  for kernel in hopper=0 hopper=1; do
    timeout "$limit" python3 benchmarks/bench_steps.py "$@" --trees 69 --attention triton --compile on --no-prefill \
      --kernel $kernel 2>&1 | grep -v "$quiet"
  done
}
if [[ ",$parts," == *",tests,"* ]]; then
  timeout 180 python3 -m pytest -q -rfE -m "gpu or not gpu" tests/test_tree_attention.py -k hopper \
    -p no:cacheprovider > "$dest/hopper_tests.log" 2>&1
  tail -n 3 "$dest/hopper_tests.log"
  grep -q " passed" "$dest/hopper_tests.log" && ! grep -q " failed" "$dest/hopper_tests.log" || exit 1
fi
if [[ ",$parts," == *",forms,"* ]]; then
  timeout 200 python3 benchmarks/bench_hopper_tree.py --trees 69,64 \
    --shapes 32x8x128@131072,32x8x128@32768,32x8x64@131072,32x8x64@1048576 --forms "$forms" 2>&1 | grep "M=" \
    | tee "$dest/hopper_forms.log"
fi
if [[ ",$parts," == *",steps,"* ]]; then
  steps_without_and_with 70 --shape llama-8b --contexts 32768,131072 | tee "$dest/steps_8b_hopper.log"
fi
if [[ ",$parts," == *",rounds,"* ]]; then
  timeout 300 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768,131072 --trees 69 \
    --attention triton --compile on --random-draft --kernel hopper=1 \
    --proposals "4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1" 2>&1 | grep -v "$quiet" \
    | tee "$dest/rounds_8b_hopper.log"
fi
if [[ ",$parts," == *",long,"* ]]; then
  steps_without_and_with 150 --shape llama-1b --contexts 1048576 | tee "$dest/steps_1b_1m_hopper.log"
  for d in 64 128; do  # a long prefill's causal attention by head size (the 1B target's heads are of 64)
    timeout 100 python3 benchmarks/bench_causal.py --lengths 131072,262144 --head-dim $d --repeats 3 2>&1 \
      | grep -v "^{"
  done | tee "$dest/causal_by_head_dim.log"
  {  # heads of 64 at 1M: the whole causal prompt, and chunks of queries over all the keys
    timeout 90 python3 benchmarks/bench_causal.py --lengths 1048576 --head-dim 64 --repeats 1 --backends cudnn
    timeout 60 python3 benchmarks/bench_causal.py --lengths 524288,1048576 --queries 16384 --head-dim 64 \
      --backends cudnn
  } 2>&1 | grep -v "^{" | tee -a "$dest/causal_by_head_dim.log"
fi
if [[ ",$parts," == *",batch,"* ]]; then
  steps_without_and_with 90 --shape llama-8b --contexts 32768 --batch 4 | tee "$dest/steps_8b_batch4_hopper.log"
fi
if [[ ",$parts," == *",sizes,"* ]]; then
  timeout 150 python3 benchmarks/bench_hopper_tree.py --trees 32,48,64,69,96 \
    --shapes 32x8x128@32768,32x8x128@131072,32x8x64@1048576 --forms default 2>&1 | grep "M=" \
    | tee "$dest/hopper_by_tree_size.log"
  timeout 60 python3 benchmarks/bench_causal.py --lengths 131072 --queries 16384 --head-dim 128 --backends cudnn \
    2>&1 | grep -v "^{" | tee -a "$dest/hopper_by_tree_size.log"
  timeout 120 python3 benchmarks/bench_steps.py --shape llama-1b --contexts 1048576 --trees 14,45,64,69 \
    --attention triton --compile on --no-prefill 2>&1 | grep -v "$quiet" | tee "$dest/steps_1b_1m_by_tree.log"
fi
if [[ ",$parts," == *",tail,"* ]]; then
  timeout -s INT 420 python3 -m pytest -q -rfE -m "gpu or not gpu" tests/test_tree_attention.py \
    tests/test_hopper_tree.py -p no:cacheprovider -k "hopper or merges_its_parts" > "$dest/tail_in_kernel_tests.log" 2>&1
  tail -n 3 "$dest/tail_in_kernel_tests.log"
  grep -q " passed" "$dest/tail_in_kernel_tests.log" && ! grep -q " failed\|Interrupt" "$dest/tail_in_kernel_tests.log" \
    || exit 1
fi
if [[ ",$parts," == *",tail-timing,"* ]]; then
  timeout 90 python3 benchmarks/bench_hopper_tree.py --trees 69,96 --forms default \
    --shapes 32x8x128@32768,32x8x128@131072,32x8x64@1048576 2>&1 | grep "M=" | tee "$dest/tail_in_kernel_forms.log"
  {
    timeout 90 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768,131072 --trees 69 \
      --attention triton --compile on --no-prefill 2>&1 | grep -v "$quiet"
    timeout 90 python3 benchmarks/bench_steps.py --shape llama-1b --contexts 1048576 --trees 69 \
      --attention triton --compile on --no-prefill 2>&1 | grep -v "$quiet"
  } | tee "$dest/tail_in_kernel_steps.log"
fi
if [[ ",$parts," == *",profile,"* ]]; then
  timeout 240 python3 benchmarks/bench_steps.py --shape llama-1b --contexts 1048576 --trees 69 --attention triton \
    --no-prefill --profile --kernel hopper=1 2>&1 | grep -v "$quiet" | tee "$dest/steps_1b_1m_profile.log"
fi
