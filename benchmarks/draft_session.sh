#!/usr/bin/env bash
# Issue 10's larger draft run on nvidia-h200-x2, after part 00 of the default model was copied to
# /root/stage by a first call (as for gpu_session.sh). PHASES picks what runs (default: all three):
#   chats   self-distillation data: `longspec self-distill` on both GPUs (shards 0/2 and 1/2, same
#           seed) over the documents of installed packages, except the ones kept for evaluation
#           (transformers httpx starlette rich; the standard library is refused anyway). Skipped when
#           .data/chats.tar.part.* is carried (a previous session's chats): then they are unpacked.
#           Written back as $OUT/chats.tar.part.* (carry them as .data/ in later sessions: the data,
#           and so the sample order, must stay the same across a run's sessions).
#   train   torchrun on 2 GPUs: every installed package except the evaluation ones, plus the chats,
#           with --distill (KL to the target on every token), global batch
#           2 x BATCH x 2048 tokens, TRAIN_STEPS steps in all (the learning-rate schedule), until
#           TRAIN_TIMEOUT seconds; it resumes the run in /root/stage/bigdraft (a later call of the
#           same warm session) or, with RESUME=1, the checkpoint carried as .ckpt/draft.tar.part.*.
#           The newest checkpoint comes back as $OUT/draft.tar.part.* (15 MiB parts).
#   export  the trained draft in bf16 with its reduced vocabulary (the 8192 most frequent tokens of
#           numpy + networkx) and its acceptance table (httpx + starlette: held out), as
#           $OUT/export.tar (with metrics.jsonl and the logs): unpack over longspec/assets/ to ship.
# Resuming a run: its checkpoint (~49 MB) and the model's parts do not fit one call's 64 MiB
# together: call 1 carries .stage/smol.part.00 (copied to /root/stage); call 2 carries .ckpt
# (`mkdir -p /root/stage/ckpt && cp .ckpt/draft.tar.part.* /root/stage/ckpt/`); call 3 the other
# model parts, the sha256, the gguf wheel and .data, with RESUME=1 (the chats phase then only
# unpacks the carried chats).
# Training compiles the draft's forward/backward and the loss chunks (`longspec train`'s CUDA
# default; 486k against 265k tokens/s eager with --distill, train_bench_distill_compile_h200.log);
# COMPILE=off (or 0) trains eagerly. The call limit is 600 s: run `PHASES="chats train"` in one call and
# `PHASES="train export"` in the next (the machine stays warm 30 s between calls).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
PHASES=${PHASES:-"chats train export"}
# a call's phases must end within its 600 s: training yields to the chats in the same call
case " $PHASES " in *" chats "*) TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-240} ;; *) TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-420} ;; esac
STEPS="convert" bash benchmarks/gpu_session.sh >/dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$PWD
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
EVAL="transformers httpx starlette rich"
RUN=/root/stage/bigdraft
packages() {  # top-level package directories of site-packages, without the evaluation ones
  for p in "$SITE"/*/; do
    name=$(basename "$p")
    case " $EVAL " in *" $name "*) continue ;; esac
    case $name in *.dist-info|*.egg-info|__pycache__) continue ;; esac
    echo "${p%/}"
  done
}
for phase in $PHASES; do
  case $phase in
    chats)
      if ls .data/chats.tar.part.* >/dev/null 2>&1; then
        cat .data/chats.tar.part.* | tar -xz -C /root/stage && echo "chats carried: $(ls /root/stage/chats.*.jsonl)"
      elif [ ! -f /root/stage/chats.1.jsonl ]; then
        for i in 0 1; do
          timeout ${SD_TIMEOUT:-200} python3 -m longspec.cli self-distill --target /root/stage/smol-hf --docs $(packages) \
            --out /root/stage/chats.$i.jsonl --shard $i/2 --limit ${SD_LIMIT:-6000} --batch ${SD_BATCH:-32} \
            --device cuda:$i --seed 11 > "/root/stage/chats.$i.log" 2>&1 &
        done
        wait
        # a shard cut by its timeout may end in a half-written line: drop it (records end with "}")
        for i in 0 1; do [ -f /root/stage/chats.$i.jsonl ] && sed -i '$ { /}$/!d }' /root/stage/chats.$i.jsonl; done
        tail -n 2 /root/stage/chats.*.log; wc -l /root/stage/chats.*.jsonl
        tar -C /root/stage -czf - chats.0.jsonl chats.1.jsonl | split -b 15m -d - "$OUT/chats.tar.part."
      fi ;;
    train)
      # the checkpoint carried in .ckpt/, or staged in /root/stage/ckpt/ by an earlier call of this
      # session (a checkpoint and the model's big part together pass one call's 64 MiB)
      ckpt=$(ls .ckpt/draft.tar.part.* 2>/dev/null || ls /root/stage/ckpt/draft.tar.part.* 2>/dev/null)
      if [ -n "${RESUME:-}" ] && [ ! -d $RUN ] && [ -n "$ckpt" ]; then
        mkdir -p $RUN && cat $ckpt | tar -x -C $RUN && echo "restored $(cat $RUN/checkpoints/latest)"
      fi
      resume=""; [ -f $RUN/checkpoints/latest ] && resume="--resume"
      case ${COMPILE:-auto} in 0|off) compile=off ;; 1|on) compile=on ;; *) compile=auto ;; esac
      chats=$(for f in /root/stage/chats.*.jsonl; do [ -s "$f" ] && echo "$f"; done)  # a shard may have failed
      timeout $TRAIN_TIMEOUT torchrun --standalone --nproc_per_node 2 -m longspec.cli train \
        --target /root/stage/smol-hf --data "$SITE" $chats \
        --exclude $EVAL '*.dist-info' --out $RUN --seq-len 2048 --batch-size ${BATCH:-16} \
        --steps ${TRAIN_STEPS:-8000} --lr 1e-3 --warmup 200 --window 512 --distill --compile $compile \
        --eval-every 500 --save-every ${SAVE_EVERY:-250} --eval-chunks 64 --log-every 25 --device cuda --dtype bfloat16 \
        --no-progress --data-cache /root/stage/tokens $resume 2>&1 | grep -v "Warning\|warn(" | tee -a /root/stage/train.log
      latest=$(cat $RUN/checkpoints/latest 2>/dev/null || true)
      if [ -n "$latest" ]; then
        rm -f "$OUT"/draft.tar.part.*
        tar -C $RUN -cf - checkpoints/latest "checkpoints/$latest" metrics.jsonl | split -b 15m -d - "$OUT/draft.tar.part."
      fi ;;
    export)  # from the newest checkpoint (a run restored from .ckpt holds only checkpoints)
      mkdir -p /root/stage/export
      python3 -m longspec.cli draft-vocab --target /root/stage/smol-hf --draft "$RUN/checkpoints/$(cat $RUN/checkpoints/latest)" --data "$SITE/numpy" "$SITE/networkx" \
        --size 8192 --out /root/stage/export/smollm2-draft 2>&1 | tail -2
      python3 benchmarks/draft_acceptance.py --target /root/stage/smol-hf --draft /root/stage/export/smollm2-draft \
        --data "$SITE/httpx" "$SITE/starlette" --write 2>&1 | tail -8
      python3 - /root/stage/export/smollm2-draft <<'PY'
import sys, torch
from longspec import load_target, load_draft, save_draft
target = load_target("/root/stage/smol-hf", dtype=torch.bfloat16, device="cuda")
save_draft(load_draft(sys.argv[1], target), sys.argv[1])  # bf16, as shipped
print("exported", sys.argv[1])
PY
      cp $RUN/metrics.jsonl /root/stage/train.log /root/stage/chats.*.log /root/stage/export/ 2>/dev/null
      tar -C /root/stage/export -cf "$OUT/export.tar" . ;;
  esac
done
