#!/usr/bin/env bash
# The warp-specialized Hopper prefix kernel (attention/hopper_prefix.py, opt-in) on one Hopper GPU,
# no model needed: its GPU tests (outputs against the float64 reference; a deadlock shows as the
# time limit), each of its forms against the Triton kernel alone (bench_hopper_prefix.py, at the
# 8B shape's 32k and 128k and 1B's 1M keys), then whole compiled steps of an 8B-shaped target at
# 32k and 128k without and with it (bench_steps.py --kernel hopper=1).
#   bash benchmarks/hopper_prefix.sh [--out DIR]
# Logs in DIR: hopper_tests.log, hopper_forms.log, steps_8b_hopper.log.
set -uo pipefail
KNOWN=""
source "$(dirname "$0")/_args.sh"
parse_args "$@"
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
timeout 150 python3 -m pytest -q -rfE -m "gpu or not gpu" tests/test_tree_attention.py -k hopper \
  -p no:cacheprovider > "$dest/hopper_tests.log" 2>&1
tail -n 3 "$dest/hopper_tests.log"
grep -q " passed" "$dest/hopper_tests.log" && ! grep -q " failed" "$dest/hopper_tests.log" || exit 1
timeout 240 python3 benchmarks/bench_hopper_prefix.py 2>&1 | grep -v "^{" | tee "$dest/hopper_forms.log"
for kernel in hopper=0 hopper=1; do
  timeout 280 python3 benchmarks/bench_steps.py --shape llama-8b --contexts 32768,131072 --trees 69 \
    --attention triton --compile on --random-draft --kernel $kernel \
    --proposals "4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1" 2>&1 | grep -v "Warning\|warn(\|^{\|softmax\|^$"
done | tee "$dest/steps_8b_hopper.log"
