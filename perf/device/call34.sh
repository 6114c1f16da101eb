# h200 (tenth session): wan-14b-480p (compute-bound) with weight_codec="auto" against resident-tfill: the plan
# should code nothing and the step stay at the resident one; then the auto-codec GPU tests again (their graphs
# case counted replays wrongly in call33; sampling now encodes tensors in parallel, coded blocks give their raw
# pages back). WEIGHTSTREAM_COMMIT must be given. ~330 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${WAN_TIMEOUT:-300} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 140 --out "$OUT" \
  --modes ${WAN_MODES:-resident-tfill,layerwise-codedauto} > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec" "$OUT/wan.log" | tail -6
timeout ${GPU_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_auto_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
