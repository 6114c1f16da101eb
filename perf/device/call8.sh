# h200: issue 14/15 flux modes (coded, auto placement vs fixed counts, pinned budget at half).
# WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
nproc; free -g | head -2
timeout ${FLUX_TIMEOUT:-540} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout ${MODE_TIMEOUT:-150} --out "$OUT" \
  --modes ${FLUX_MODES:-resident,layerwise,layerwise-coded,graphs-coded,layerwise-auto-16gb,layerwise-r25-16gb,layerwise-auto-8gb,layerwise-r9-8gb,layerwise-auto-12gb,layerwise-r14-12gb,layerwise-pinned-half,layerwise-pageable-half} \
  > "$OUT/flux.log" 2>&1; echo "flux rc=$?"; grep -vE "^\[[0-9:]+\] " "$OUT/flux.log" | tail -30
ls $OUT
