#!/usr/bin/env bash
# compute-sanitizer over the RoPE, QK-norm + RoPE, RMSNorm and LayerNorm GPU tests: memcheck (out-of-bounds, misaligned accesses) and
# racecheck (shared-memory races). Usage: tools/sanitize.sh [pytest -k expression]; needs a CUDA GPU.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
SUBSET=${1:-"not huge and not fuzz"}
status=0
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/rope tests/qk_norm_rope tests/rmsnorm tests/layernorm -k "$SUBSET" || status=$?
done
exit $status
