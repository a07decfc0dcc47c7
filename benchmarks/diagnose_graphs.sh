export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage/gguf-0.19.0-py3-none-any.whl 2>/dev/null
timeout 120 python3 benchmarks/diagnose_graphs.py --part hybrid-test > $OUT/diag_hybrid.log 2>&1; echo "hybrid rc $?"
timeout 120 python3 benchmarks/diagnose_graphs.py --part costs --long 0 --contexts 2048 > $OUT/diag_costs_short.log 2>&1; echo "short rc $?"
timeout 150 python3 benchmarks/diagnose_graphs.py --part costs --long 7900 --contexts 8113,2048 > $OUT/diag_costs_long.log 2>&1; echo "long rc $?"
grep -v Warning $OUT/diag_costs_short.log | tail -5; grep -v Warning $OUT/diag_costs_long.log | tail -8; grep -B2 -A25 "CAPTURE FAILED\|capturing=True" $OUT/diag_hybrid.log | head -80; tail -5 $OUT/diag_hybrid.log
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if ! grep -q ^OK $OUT/diag_costs_short.log; then args="--long 0 --contexts 2048"; elif ! grep -q ^OK $OUT/diag_costs_long.log; then args="--long 7900 --new 8 --contexts 2048"; else args=""; fi
if [ -n "$args" ] && [ -n "$san" ]; then timeout 200 $san --tool memcheck --print-limit 3 python3 benchmarks/diagnose_graphs.py --part costs $args > $OUT/diag_sanitizer.log 2>&1; grep -v Warning $OUT/diag_sanitizer.log | head -60; fi
