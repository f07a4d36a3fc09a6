#!/usr/bin/env bash
# One device call: GPU tests, then timings (default build and a tuning sweep). Logs go to $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q tests/ -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 150 python3 scripts/smoke_perf.py 2>&1 | tee "$OUT/perf.log"
for opts in ${SWEEP:-}; do
  CUPYROPE_EXTRA_NVRTC_OPTIONS="${opts//,/ }" timeout 60 python3 scripts/smoke_perf.py --rope-only 2>&1 | tee -a "$OUT/sweep.log"
done
