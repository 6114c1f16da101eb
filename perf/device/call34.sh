# h200 (tenth session): wan-14b-480p (compute-bound) with weight_codec="auto" against resident-tfill: the plan
# should code nothing and the step stay at the resident one. WEIGHTSTREAM_COMMIT must be given. ~260 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${WAN_TIMEOUT:-300} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 140 --out "$OUT" \
  --modes ${WAN_MODES:-resident-tfill,layerwise-codedauto} > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec" "$OUT/wan.log" | tail -6
