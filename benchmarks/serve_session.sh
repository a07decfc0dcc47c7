#!/usr/bin/env bash
# The serving benchmark, as the second call of a session (part 00 of the default model copied to
# /root/stage by the first, the other parts, the gguf wheel and .whl/serve carried): with a GPU per
# server (nvidia-h200-x2) each server of SERVERS runs on a GPU of its own at the same time
# (bench_serve.py once per GPU), so the hybrid's start-up (compilation and capture of every bucket)
# does not wait for the plain one; with fewer GPUs the servers run one after another on GPU 0.
# Logs: $OUT/serve_gpu<i>.log, one per server. CONCURRENCY, SERVE_ARGS, DRAFT as in gpu_session.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS="convert" bash benchmarks/gpu_session.sh >/dev/null 2>&1 || { echo "model conversion failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/serve .whl/serve/*.whl 2>&1 | grep -v WARNING
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/serve:/tmp/site:$PWD
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
IFS=";" read -ra servers <<< "${SERVERS:-none;hybrid}"
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
pids=()
for i in "${!servers[@]}"; do
  parallel=1; gpu=$i; [ "$GPUS" -ge "${#servers[@]}" ] || { parallel=0; gpu=0; }
  CUDA_VISIBLE_DEVICES=$gpu timeout ${SERVE_TIMEOUT:-540} python3 benchmarks/bench_serve.py --target /root/stage/smol-hf \
    --draft ${DRAFT:-longspec/assets/smollm2-draft} --prompt-dir "$SITE/transformers/generation" \
    --concurrency ${CONCURRENCY:-1,4,16} --servers "${servers[$i]}" --serve-args "${SERVE_ARGS:---buckets 1,4,16}" \
    > "$OUT/serve_gpu$i.log" 2>&1 &
  if [ $parallel = 1 ]; then pids+=($!); else wait $!; fi
done
wait "${pids[@]}"
grep -h -v "Warning\|warn(\|^$\|Online softmax\|split the reduction\|important use case\|softmax\.\|clean_up_tokenization" \
  "$OUT"/serve_gpu*.log
