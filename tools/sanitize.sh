#!/usr/bin/env bash
# compute-sanitizer over the RoPE, QK-norm + RoPE, RMSNorm and LayerNorm GPU tests: memcheck (out-of-bounds, misaligned
# accesses) over a subset that runs every kernel family and layout once, and racecheck (shared-memory races; much
# slower) over a smaller one of the kernels that share memory between threads (the block RoPE kernel, rows reduced
# over several warps, rows staged or cached in shared memory, rows split over a cluster). Both run at once, each for at
# most SANITIZE_SECONDS (default 540; a tool cut off there exits 124 with its progress in its log), and each log is
# printed when both are done.
# Usage: tools/sanitize.sh [memcheck's pytest -k expression] [racecheck's]; needs a CUDA GPU.
set -u
export PYTHONPATH=${PYTHONPATH:-.}
MEMCHECK_SUBSET=${1:-"decode or (rope_cos_sin_rotates and bfloat16 and cupy) or (rows_at_any_alignment and bfloat16) or one_cluster or two_pass or outside_every or mrope_matches or (backward_matches and bfloat16 and cupy) or (add_rms_norm_views and cupy) or (residual_grad and cupy and 4096) or (fp8 and cupy and (views or saturation or conversion)) or (layernorm_gpu and (((test_forward or test_backward) and -7-) or (unaligned and cupy) or empty or splits_long_rows)) or ((test_forward_split_rows or test_backward_split_rows) and bfloat16 and cupy) or (blocks_walking_rows and bfloat16 and 4096)"}
RACECHECK_SUBSET=${2:-"(test_every_variant and block and bfloat16 and vector and full and out) or (test_qk_norm_rope_matches_the_reference and prefill and bfloat16 and cupy and theta and neox) or (qk_norm_rope and backward_matches and bfloat16 and cupy) or (rmsnorm_forward_gpu and test_forward[ and bfloat16 and -4096]) or (test_fused_add_row_cache and bfloat16 and cupy) or (test_forward_split_rows and bfloat16 and cupy) or (test_backward_staged_rows and bfloat16 and cupy) or (test_backward_two_pass_rows and bfloat16 and cupy) or (test_backward_one_cluster and bfloat16 and cupy) or (fp8 and blocks_walking_rows and bfloat16 and 4096) or (test_rms_norm_fp8[ and cupy and bfloat16 and -4096- and not static) or (layernorm_gpu and (test_forward[ or test_backward[) and bfloat16 and -4096]) or (layernorm_gpu and splits_long_rows and bfloat16)"}
LOGS=$(mktemp -d)
sanitize() {  # tool, subset
  timeout "${SANITIZE_SECONDS:-540}" compute-sanitizer --tool "$1" --error-exitcode 99 --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider tests/rope tests/qk_norm_rope tests/rmsnorm tests/layernorm \
    -k "not huge and not fuzz and ($2)" > "$LOGS/$1.log" 2>&1
}
sanitize memcheck "$MEMCHECK_SUBSET" & memcheck=$!
sanitize racecheck "$RACECHECK_SUBSET" & racecheck=$!
status=0
wait $memcheck || status=$?
wait $racecheck || status=$?
for tool in memcheck racecheck; do echo "== compute-sanitizer --tool $tool"; cat "$LOGS/$tool.log"; done
rm -rf "$LOGS"
exit $status
