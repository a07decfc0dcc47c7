#!/usr/bin/env bash
# Second device call of a GPU session (see README "Benchmarks"): reassembles the default model
# (staged by ../shared/tools/stage-smollm2.sh; part 00 copied to /root/stage by the first call),
# converts it, runs the GPU tests, trains the draft on real source code and runs the benchmarks.
# STEPS selects what runs (default: convert steps bench tests), each limited to STEP_TIMEOUT s:
#   convert   GGUF -> /root/stage/smol-hf            tests     pytest -m gpu tests/test_gpu.py
#   steps     bench_steps.py (default model)          bench     bench_generate.py (vs transformers)
#   train     draft training                          repro     the 7.9k Triton crash, localised
#   attention bench_attention.py (8B shape, op)       steps8b   bench_steps.py --shape llama-8b --hf
#   trainbench bench_train.py (random SmolLM2 shape)  stepsrand bench_steps.py --shape smollm2 (no model needed)
#   serve     bench_serve.py (needs the wheels in .whl/serve, carried: see README "Benchmarks")
#   sweep     bench_attention.py --sweep (the kernel's launch parameters per shape)
#   stepsbatch bench_steps.py at batch 1 and 16 (STEP_BATCHES) with hybrid proposals (serving buckets)
# WRAP prefixes the bench step's command (e.g. WRAP="compute-sanitizer --tool memcheck --print-limit 5",
# or set CUDA_LAUNCH_BLOCKING=1), to localise the illegal memory access of README "Status".
# The draft trains on the machine's site-packages except transformers, httpx, starlette and rich
# (evaluation: benchmark prompts, the acceptance table, tau tables) and the standard library.
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"convert steps bench tests"}
T=${STEP_TIMEOUT:-400}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ ! -f /root/stage/smol-hf/config.json ] && [ -f .stage/smol.part.01 ]; then  # steps without the model skip this
  cat /root/stage/smol.part.00 .stage/smol.part.01 .stage/smol.part.02 > /root/stage/smol.gguf
  echo "$(cat .stage/smol.sha256)  /root/stage/smol.gguf" | sha256sum -c -
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage/gguf-0.19.0-py3-none-any.whl 2>/dev/null || true
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for step in $STEPS; do
  case $step in
    convert) [ -f /root/stage/smol-hf/config.json ] || python3 -m longspec.cli convert --gguf /root/stage/smol.gguf --out /root/stage/smol-hf ;;
    tests) timeout $T python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || true ;;
    steps) timeout $T python3 benchmarks/bench_steps.py --target /root/stage/smol-hf ${DRAFT:+--draft $DRAFT} \
             --contexts ${CONTEXTS:-2048,8192} --attention ${ATTENTION:-triton,matmul,sdpa} 2>&1 | tee "$OUT/steps.log" || true ;;
    train) # every installed package except those kept for evaluation (and the stdlib, which train refuses).
           # A run spans sessions: RESUME=1 with the parts of the last session's checkpoint carried in .ckpt/
           # (copied there from its $OUT/draft.tar.part.*), and this run's newest checkpoint goes back the same way.
           if [ -n "${RESUME:-}" ] && ls .ckpt/draft.tar.part.* >/dev/null 2>&1; then
             rm -rf /root/stage/draft && cat .ckpt/draft.tar.part.* | tar -x -C /root/stage && echo "restored $(cat /root/stage/draft/checkpoints/latest)"
           fi
           timeout ${TRAIN_TIMEOUT:-330} python3 -m longspec.cli train --target /root/stage/smol-hf \
             --data ${TRAIN_DATA:-$SITE} --exclude ${EXCLUDE:-transformers httpx starlette rich} '*.dist-info' \
             --out /root/stage/draft \
             --seq-len 2048 --batch-size ${BATCH:-16} --steps ${TRAIN_STEPS:-1500} --lr 1e-3 --warmup 100 \
             --window 512 ${MAX_LAG:+--max-lag $MAX_LAG} --eval-every 250 --save-every 250 --eval-chunks 32 --log-every 25 \
             --device cuda --dtype bfloat16 --no-progress --data-cache /root/stage/tokens ${RESUME:+--resume} \
             --compile ${COMPILE_TRAIN:-auto} 2>&1 | tee "$OUT/train.log" || true
           cp /root/stage/draft/metrics.jsonl "$OUT/" || true
           latest=$(cat /root/stage/draft/checkpoints/latest 2>/dev/null || true)
           if [ -n "$latest" ]; then  # the newest checkpoint (weights, optimizer, data position), in <= 15 MiB parts
             tar -C /root/stage -cf - draft/checkpoints/latest "draft/checkpoints/$latest" draft/metrics.jsonl \
               | split -b 15m -d - "$OUT/draft.tar.part."
           fi
           python3 - "$OUT/smollm2-draft" <<'PY'
import sys, torch
from longspec import load_target, load_draft, save_draft
target = load_target("/root/stage/smol-hf", dtype=torch.bfloat16, device="cuda")
save_draft(load_draft("/root/stage/draft", target), sys.argv[1])  # bf16 copy to ship
print("exported", sys.argv[1])
PY
           ;;
    bench) timeout $T ${WRAP:-} python3 benchmarks/bench_generate.py --target /root/stage/smol-hf --prompt-dir "$SITE/transformers/generation" \
             ${DRAFT:+--draft $DRAFT} --lengths ${LENGTHS:-2048,7900} --max-new-tokens ${NEW:-128} --repeats ${REPEATS:-3} \
             --attention ${BENCH_ATTENTION:-triton+compile,matmul+compile} --methods ${METHODS:-ar,pld,longspec,hybrid,auto} \
             --hf ${HF:-dynamic,static,pld} 2>&1 | tee "$OUT/bench.log" || true ;;
    trainbench) timeout $T python3 benchmarks/bench_train.py --shape smollm2 --seq-len 2048 --batch ${TRAIN_BATCH:-16,32} \
             --chunk 4096 --compile ${TRAIN_COMPILE:-off,on} 2>&1 | tee "$OUT/train_bench.log" || true ;;
    stepsrand) timeout $T python3 benchmarks/bench_steps.py --shape smollm2 --random-draft --contexts ${CONTEXTS:-2048,8192} \
             --trees ${TREES:-16,69} --attention ${ATTENTION:-matmul,triton} --compile ${COMPILE:-on,off} 2>&1 | tee "$OUT/steps_rand.log" || true ;;
    stepsbatch) # steps and proposals at serving batch sizes (the cost of each bucket's tree)
           for b in ${STEP_BATCHES:-1 16}; do
             timeout $T python3 benchmarks/bench_steps.py --shape smollm2 --random-draft --contexts ${CONTEXTS:-2048} \
               --trees 16,69 --attention triton --compile on --batch $b \
               --proposals "${PROPOSALS:-4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1;hybrid:4,8,8,8,8;hybrid:2,2,2}" \
               2>&1 | tee "$OUT/steps_batch$b.log" || true
           done ;;
    repro) # the command that crashed before (no per-phase syncs); /root/stage/triton_ok records a pass
           rm -f /root/stage/triton_ok
           if timeout 150 python3 benchmarks/repro_long_context.py --length 7900 --new 128 --calls 2 --generators 2 \
                --attention triton --pld 2>&1 | tee "$OUT/repro.log" | grep -q "^OK"; then touch /root/stage/triton_ok; fi
           tail -5 "$OUT/repro.log"
           if [ -n "${SANITIZER:-}" ]; then  # compute-sanitizer memcheck (slow: minutes)
             san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
             timeout ${SANITIZER_TIMEOUT:-240} "$san" --tool memcheck --print-limit 5 python3 benchmarks/repro_long_context.py \
               --length 7900 --new 128 --calls 2 --generators 2 --attention triton --pld 2>&1 | tail -60 > "$OUT/sanitizer.log" || true
           fi ;;
    serve) # the carried set (pip's resolved closure of fastapi + uvicorn) as a whole, ahead of the
           # machine's own packages (a newer FastAPI needs a newer pydantic, and opentelemetry-api)
           python3 -m pip install -q --no-index --no-deps --target /tmp/serve .whl/serve/*.whl 2>&1 | grep -v WARNING || true
           PYTHONPATH=/tmp/serve:$PYTHONPATH python3 -c "import fastapi, uvicorn; print('fastapi', fastapi.__version__)" || true
           PYTHONPATH=/tmp/serve:$PYTHONPATH timeout $T python3 benchmarks/bench_serve.py --target /root/stage/smol-hf --draft ${DRAFT:-longspec/assets/smollm2-draft} \
             --prompt-dir "$SITE/transformers/generation" --concurrency ${CONCURRENCY:-1,4,16,64} \
             --servers "${SERVERS:-none;hybrid;pld}" --serve-args "${SERVE_ARGS:---buckets 1,4,16,64}" 2>&1 \
             | tee "$OUT/serve.log" || true ;;
    attention) timeout $T python3 benchmarks/bench_attention.py 2>&1 | tee "$OUT/attention.log" || true ;;
    sweep) timeout $T python3 benchmarks/bench_attention.py --sweep --contexts ${SWEEP_CONTEXTS:-32768} --trees ${SWEEP_TREES:-64,69} \
             --repeats 20 2>&1 | tee "$OUT/attention_sweep.log" || true ;;
    steps8b) timeout $T python3 benchmarks/bench_steps.py --shape llama-8b --contexts ${CONTEXTS_8B:-8192,32768,131072} \
             --trees ${TREES_8B:-16,69,128} --attention ${ATTENTION_8B:-triton,matmul} --compile ${COMPILE_8B:-off} ${KERNEL_8B:+--kernel $KERNEL_8B} ${HF_8B---hf} 2>&1 | tee "$OUT/steps_8b.log" || true ;;
  esac
done
