#!/usr/bin/env bash
# Everything the GPU must confirm, in one device call: the GPU test suite (its parts at once:
# RoPE, RMSNorm forward, RMSNorm backward, the rest), the reliability suite, `python -m cupyrope check` and
# compute-sanitizer over a subset; then, if asked, the benchmarks.
# Usage on the device machine, from the checkout, with the wheels of tools/fetch_wheels.sh carried in .whl/:
#   bash tools/gpu_suite.sh                                   (the suite)
#   STEPS="suite bench" bash tools/gpu_suite.sh               (and `bench --full`, its JSON and plot)
#   STEPS="qk rms add fp8 ln model" bash tools/gpu_suite.sh   (`bench --op qk_norm_rope`, `--op rmsnorm`,
#                                                             `--op add_rms_norm`, `--op rms_norm_fp8`,
#                                                             `--op layer_norm`, `--op model`)
#   SANITIZE="pytest -k expression" and RACECHECK="..." pick memcheck's and racecheck's subsets (tools/sanitize.sh); MODEL_OPTIONS="--family llama-3 --regime prefill"
#   narrows the model step.
# $OUT gets few files (a device call brings back only a handful): summary.txt, logs.tgz (every log) and the
# benchmarks' JSON and plots.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=/tmp/gpu_suite_logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=.:/tmp/site
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-suite}
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for step in $STEPS; do
  echo "== $step"
  case $step in
    suite)
      gpu_tests() { timeout 560 python3 -m pytest -q -m "gpu and not huge" -p no:cacheprovider "$@"; }
      # The slowest parts split further: one RMSNorm backward process took over 400 s on an H200.
      backward=tests/rmsnorm/test_rmsnorm_backward_gpu.py
      gpu_tests tests/api tests/runtime tests/cli --ignore=tests/api/test_reliability_gpu.py \
        > "$LOGS/suite_other.log" 2>&1 &
      gpu_tests tests/qk_norm_rope tests/torch > "$LOGS/suite_qk_torch.log" 2>&1 &
      gpu_tests tests/rope > "$LOGS/suite_rope.log" 2>&1 &
      gpu_tests tests/rmsnorm/test_rmsnorm_forward_gpu.py tests/rmsnorm/test_add_rms_norm_gpu.py \
        > "$LOGS/suite_rms_fwd.log" 2>&1 &
      gpu_tests tests/rmsnorm/test_rms_norm_fp8_gpu.py > "$LOGS/suite_rms_fp8.log" 2>&1 &
      gpu_tests tests/layernorm > "$LOGS/suite_layernorm.log" 2>&1 &
      gpu_tests "$backward" -k "test_backward[ or staged_rows or reread_rows or dweight or without_weight" \
        > "$LOGS/suite_rms_bwd_1.log" 2>&1 &
      gpu_tests "$backward" -k "one_cluster or cluster_rounds or two_pass" > "$LOGS/suite_rms_bwd_2.log" 2>&1 &
      gpu_tests "$backward" -k "split_rows or shifted" > "$LOGS/suite_rms_bwd_3.log" 2>&1 &
      timeout 560 python3 -m pytest -q tests/api/test_reliability_gpu.py -p no:cacheprovider > "$LOGS/reliability.log" 2>&1 &
      timeout 300 python3 -m cupyrope check > "$LOGS/check.log" 2>&1 &
      bash tools/sanitize.sh "${SANITIZE:-}" "${RACECHECK:-}" > "$LOGS/sanitize.log" 2>&1 &
      wait
      for log in "$LOGS"/suite_*.log "$LOGS/reliability.log"; do echo "$(basename "$log"): $(tail -1 "$log")"; done
      grep -E "FAIL|passed" "$LOGS/check.log" | tail -3
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|==" "$LOGS/sanitize.log" ;;
    bench) timeout 560 python3 -m cupyrope bench --full --json "$OUT/bench.json" --plot "$OUT/bench.png" \
             > "$LOGS/bench.log" 2>&1; tail -5 "$LOGS/bench.log" ;;
    rms) timeout 300 python3 -m cupyrope bench --op rmsnorm --json "$OUT/rms.json" > "$LOGS/rms.log" 2>&1
        grep "^| rms" "$LOGS/rms.log" | grep -v "no PDL" ;;
    add) timeout 300 python3 -m cupyrope bench --op add_rms_norm --json "$OUT/add.json" > "$LOGS/add.log" 2>&1
        grep "^| add_" "$LOGS/add.log" ;;
    fp8) timeout 300 python3 -m cupyrope bench --op rms_norm_fp8 --json "$OUT/fp8.json" > "$LOGS/fp8.log" 2>&1
        grep "^| fp8" "$LOGS/fp8.log" | grep -v "no PDL" ;;
    ln) timeout 400 python3 -m cupyrope bench --op layer_norm --json "$OUT/ln.json" > "$LOGS/ln.log" 2>&1
        grep "^| ln" "$LOGS/ln.log" | grep -v "no PDL" ;;
    qk) timeout 300 python3 -m cupyrope bench --op qk_norm_rope --json "$OUT/qk.json" > "$LOGS/qk.log" 2>&1
        grep "^| qk_norm_rope\|^| rope_qk" "$LOGS/qk.log" ;;
    model) timeout 560 python3 -m cupyrope bench --op model --rounds 2 ${MODEL_OPTIONS:-} --json "$OUT/model.json" \
             --plot "$OUT/model.png" > "$LOGS/model.log" 2>&1; tail -25 "$LOGS/model.log" ;;
    pytest-bench) timeout 400 python3 -m pytest -q tests/benchmarks --benchmark-only -p no:cacheprovider \
             --benchmark-json="$OUT/benchmarks.json" 2>&1 | tail -15 ;;
  esac
done
} 2>&1 | tee "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
