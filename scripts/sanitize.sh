#!/usr/bin/env bash
# compute-sanitizer over the GPU tests: memcheck (out-of-bounds, misaligned accesses) and racecheck
# (shared-memory races). Usage: scripts/sanitize.sh [pytest -k expression]; needs a CUDA GPU.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
SUBSET=${1:-"not huge and not fuzz"}
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/test_rope_gpu.py tests/test_rmsnorm_gpu.py -k "$SUBSET" \
    || status=$?
done
exit $status
