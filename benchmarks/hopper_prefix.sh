#!/usr/bin/env bash
# The warp-specialized Hopper prefix kernel (attention/hopper_prefix.py) on one Hopper GPU, no
# model needed, in about 7 minutes: its GPU tests (outputs against the float64 reference; a
# deadlock shows as the time limit), the forms named by --forms (default: the default form and
# "neither", without ping-pong and overlap) against the Triton kernel alone
# (bench_hopper_prefix.py, the 8B shape at 32k and 128k keys), whole compiled steps of an
# 8B-shaped target at 32k and 128k without and with it (bench_steps.py --no-prefill --kernel
# hopper=0|1), then its rounds with a random draft.
#   bash benchmarks/hopper_prefix.sh [--out DIR] [--forms "default,neither"]
# Logs in DIR: hopper_tests.log, hopper_forms.log, steps_8b_hopper.log, rounds_8b_hopper.log.
set -uo pipefail
KNOWN="forms"
forms="default,neither"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
quiet="Warning\|warn(\|^{\|softmax\|^$"
timeout 150 python3 -m pytest -q -rfE -m "gpu or not gpu" tests/test_tree_attention.py -k hopper \
  -p no:cacheprovider > "$dest/hopper_tests.log" 2>&1
tail -n 3 "$dest/hopper_tests.log"
grep -q " passed" "$dest/hopper_tests.log" && ! grep -q " failed" "$dest/hopper_tests.log" || exit 1
timeout 90 python3 benchmarks/bench_hopper_prefix.py --trees 69,64 --shapes 32x8x128@131072,32x8x128@32768 \
  --forms "$forms" 2>&1 | grep "M=" | tee "$dest/hopper_forms.log"
for kernel in hopper=0 hopper=1; do
  timeout 60 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768,131072 --trees 69 \
    --attention triton --compile on --no-prefill --kernel $kernel 2>&1 | grep -v "$quiet"
done | tee "$dest/steps_8b_hopper.log"
timeout 150 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768,131072 --trees 69 \
  --attention triton --compile on --random-draft --kernel hopper=1 \
  --proposals "4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1" 2>&1 | grep -v "$quiet" | tee "$dest/rounds_8b_hopper.log"
