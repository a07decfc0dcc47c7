#!/usr/bin/env bash
# The GPU benchmarks and tests of docs/benchmarks.md, one after another on one GPU.
#   bash benchmarks/gpu_benchmarks.sh [--target DIR] [--draft DIR] [--out DIR] [--steps "bench tests"] ...
# --target: the model (default: the default model, SmolLM2-135M-Instruct, converted once);
# --draft: its LongSpec draft (default: the shipped one); --out: where the logs go (default:
# benchmarks/results/incoming, git-ignored). --steps picks what runs (default: "steps bench tests"),
# each limited to --step-timeout seconds (default: 1800):
#   tests      pytest -m gpu tests/                     steps      bench_steps.py on the model
#   bench      bench_generate.py against transformers   stepsrand  bench_steps.py, random SmolLM2 shape
#   attention  bench_attention.py (8B shape, op table)  sweep      bench_attention.py --sweep
#   steps8b    bench_steps.py --shape llama-8b --hf     trainbench bench_train.py (random SmolLM2 shape)
#   stepsbatch bench_steps.py at batch 1 and 16 with hybrid proposals (the serving buckets)
#   serve      bench_serve.py (needs pip install -e ".[serve]")
#   repro      repro_long_context.py (the 7.9k-token Triton run that once crashed)
# Other options (defaults in brackets): --lengths [2048,7900] --new [128] --repeats [3]
# --methods [ar,pld,longspec,hybrid,auto] --hf [dynamic,static,pld]
# --bench-attention [triton+compile,matmul+compile] --contexts [2048,8192] --attention
# [triton,matmul,sdpa] --trees [16,69] --compile [on,off] --concurrency [1,4,16,64]
# --servers ["none;hybrid;pld"] --serve-args ["--buckets 1,4,16,64"] --wrap [a command prefix for
# bench, e.g. "compute-sanitizer --tool memcheck"].
set -euo pipefail
KNOWN="target draft steps step_timeout lengths new repeats methods hf bench_attention contexts attention trees
       compile concurrency servers serve_args wrap"
source "$(dirname "$0")/_args.sh"
parse_args "$@"
steps=${steps:-"steps bench tests"}; T=${step_timeout:-1800}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for step in $steps; do
  case $step in
    tests) timeout $T python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$dest/gpu_tests.log" || true ;;
    steps) timeout $T python3 benchmarks/bench_steps.py --target "$target" --draft "$draft" \
             --contexts ${contexts:-2048,8192} --attention ${attention:-triton,matmul,sdpa} 2>&1 | tee "$dest/steps.log" || true ;;
    bench) timeout $T ${wrap:-} python3 benchmarks/bench_generate.py --target "$target" --draft "$draft" \
             --prompt-dir "$site/transformers/generation" --lengths ${lengths:-2048,7900} --max-new-tokens ${new:-128} \
             --repeats ${repeats:-3} --attention ${bench_attention:-triton+compile,matmul+compile} \
             --methods ${methods:-ar,pld,longspec,hybrid,auto} --hf ${hf:-dynamic,static,pld} 2>&1 | tee "$dest/bench.log" || true ;;
    trainbench) timeout $T python3 benchmarks/bench_train.py --shape smollm2 --seq-len 2048 --batch 16,32 \
             --chunk 4096 --compile ${compile:-off,on} 2>&1 | tee "$dest/train_bench.log" || true ;;
    stepsrand) timeout $T python3 benchmarks/bench_steps.py --shape smollm2 --random-draft --contexts ${contexts:-2048,8192} \
             --trees ${trees:-16,69} --attention ${attention:-matmul,triton} --compile ${compile:-on,off} 2>&1 \
             | tee "$dest/steps_rand.log" || true ;;
    stepsbatch) for b in 1 16; do
             timeout $T python3 benchmarks/bench_steps.py --shape smollm2 --random-draft --contexts ${contexts:-2048} \
               --trees 16,69 --attention triton --compile on --batch $b \
               --proposals "4,16,16,16,16;hybrid:4,16,16,16,16,1,1,1,1,1;hybrid:4,8,8,8,8;hybrid:2,2,2" 2>&1 \
               | tee "$dest/steps_batch$b.log" || true
           done ;;
    repro) timeout $T python3 benchmarks/repro_long_context.py --length 7900 --new 128 --calls 2 --generators 2 \
             --attention triton --pld 2>&1 | tee "$dest/repro.log" | tail -5 || true ;;
    serve) timeout $T python3 benchmarks/bench_serve.py --target "$target" --draft "$draft" \
             --prompt-dir "$site/transformers/generation" --concurrency ${concurrency:-1,4,16,64} \
             --servers "${servers:-none;hybrid;pld}" --serve-args "${serve_args:---buckets 1,4,16,64}" 2>&1 \
             | tee "$dest/serve.log" || true ;;
    attention) timeout $T python3 benchmarks/bench_attention.py 2>&1 | tee "$dest/attention.log" || true ;;
    sweep) timeout $T python3 benchmarks/bench_attention.py --sweep --contexts 32768 --trees 64,69 --repeats 20 2>&1 \
             | tee "$dest/attention_sweep.log" || true ;;
    steps8b) timeout $T python3 benchmarks/bench_steps.py --shape llama-8b --contexts ${contexts:-8192,32768,131072} \
             --trees ${trees:-16,69,128} --attention ${attention:-triton,matmul} --compile ${compile:-off} --hf 2>&1 \
             | tee "$dest/steps_8b.log" || true ;;
    *) echo "unknown step $step (see --help)" >&2; exit 2 ;;
  esac
done
