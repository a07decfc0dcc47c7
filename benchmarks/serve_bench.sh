#!/usr/bin/env bash
# The serving benchmark of docs/benchmarks.md: each server of --servers (';'-separated
# `--proposer` values, each optionally followed by more `longspec serve` options) under streaming
# clients at each --concurrency level. With as many GPUs as servers, each server runs on a GPU of
# its own at the same time (so the hybrid's start-up does not wait for the plain one's); with
# fewer, one after another on GPU 0. Needs pip install -e ".[serve]".
#   bash benchmarks/serve_bench.sh [--target DIR] [--draft DIR] [--out DIR] [--servers "none;hybrid"]
#       [--concurrency 1,4,16,64] [--serve-args "--buckets 1,4,16"] [--timeout 1800]
# Logs: DIR/serve_gpu<i>.log, one per server.
set -uo pipefail
KNOWN="target draft servers concurrency serve_args timeout"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
IFS=";" read -ra servers <<< "${servers:-none;hybrid}"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
pids=()
for i in "${!servers[@]}"; do
  parallel=1; gpu=$i; [ "$gpus" -ge "${#servers[@]}" ] || { parallel=0; gpu=0; }
  CUDA_VISIBLE_DEVICES=$gpu timeout ${timeout:-1800} python3 benchmarks/bench_serve.py --target "$target" \
    --draft "$draft" --prompt-dir "$site/transformers/generation" \
    --concurrency ${concurrency:-1,4,16,64} --servers "${servers[$i]}" --serve-args "${serve_args:---buckets 1,4,16}" \
    > "$dest/serve_gpu$i.log" 2>&1 &
  if [ $parallel = 1 ]; then pids+=($!); else wait $!; fi
done
[ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
grep -h -v "Warning\|warn(\|^$" "$dest"/serve_gpu*.log
