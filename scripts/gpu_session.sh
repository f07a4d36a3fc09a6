#!/usr/bin/env bash
# Everything the GPU must confirm, in one device call (logs under $OUT):
#   the self-check, full GPU test suite, reliability suite (fuzz, huge, threads, cache), compute-sanitizer,
#   benchmarks.
# Usage on the device machine, from the checkout, with the wheels of scripts/fetch_wheels.sh carried in .whl/:
#   bash scripts/gpu_session.sh            (STEPS="check tests reliability sanitize bench pytest-bench" to pick)
#   STEPS=suite bash scripts/gpu_session.sh  (the GPU suite's parts, the reliability suite, check and a sanitizer
#   subset, SANITIZE="pytest -k expression", all at once on the one GPU: no test times anything, and in turn they took
#   three device calls)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=.:/tmp/site
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"check tests reliability sanitize bench pytest-bench"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for step in $STEPS; do
  echo "== $step"
  case $step in
    suite)
      gpu_tests() { timeout 560 python3 -m pytest -q -m "gpu and not huge" -p no:cacheprovider "$@"; }
      gpu_tests tests/ --ignore=tests/test_reliability_gpu.py --ignore=tests/test_rmsnorm_gpu.py \
        --ignore=tests/test_rope_gpu.py > "$OUT/suite_other.log" 2>&1 &
      gpu_tests tests/test_rope_gpu.py > "$OUT/suite_rope.log" 2>&1 &
      gpu_tests tests/test_rmsnorm_gpu.py -k "not backward" > "$OUT/suite_rms_fwd.log" 2>&1 &
      gpu_tests tests/test_rmsnorm_gpu.py -k backward > "$OUT/suite_rms_bwd.log" 2>&1 &
      timeout 560 python3 -m pytest -q tests/test_reliability_gpu.py -p no:cacheprovider > "$OUT/reliability.log" 2>&1 &
      timeout 300 python3 -m cupyrope check > "$OUT/check.log" 2>&1 &
      timeout 560 bash scripts/sanitize.sh "${SANITIZE:-backward_cluster_rounds or backward_one_cluster}" > "$OUT/sanitize.log" 2>&1 &
      wait
      for log in "$OUT"/suite_*.log "$OUT/reliability.log"; do echo "$(basename "$log"): $(tail -1 "$log")"; done
      grep -E "FAIL|passed" "$OUT/check.log" | tail -3
      grep -E "SUMMARY|passed|failed|==" "$OUT/sanitize.log" ;;
    check) timeout 120 python3 -m cupyrope check 2>&1 | tee "$OUT/check.log" | grep -E "FAIL|passed" ;;
    tests) timeout 480 python3 -m pytest -q tests/ -m "gpu and not huge" --ignore=tests/test_reliability_gpu.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5 ;;
    reliability) timeout 200 python3 -m pytest -q tests/test_reliability_gpu.py -p no:cacheprovider 2>&1 \
             | tee "$OUT/reliability.log" | tail -8 ;;
    sanitize) timeout 300 bash scripts/sanitize.sh 2>&1 | grep -E "SUMMARY|passed|failed|==" | tee "$OUT/sanitize.log" ;;
    bench) timeout 400 python3 -m cupyrope bench --full --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    pytest-bench) timeout 400 python3 -m pytest -q tests/benchmarks --benchmark-only -p no:cacheprovider \
             --benchmark-json="$OUT/benchmarks.json" 2>&1 | tail -15 ;;
  esac
done
