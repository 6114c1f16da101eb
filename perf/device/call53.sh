# h200 (thirteenth session): flux-12b-1024 with the final decode kernel (1196 / 719 / 1731 GB/s): resident,
# resident-tfill (bit-exact reference), layerwise-coded, layerwise-coded2, graphs-coded, graphs-coded2,
# graphs-codedp in one run. WEIGHTSTREAM_COMMIT must be given. ~400 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-560} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 120 --out "$OUT" \
  --modes resident,resident-tfill,layerwise-coded,layerwise-coded2,graphs-coded,graphs-coded2,graphs-codedp \
  > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |bit-exact|bit_exact" "$OUT/flux.log" | tail -12
