# After the redesign (issue 13): flux/wan regression perf + perf check at 1%, then the GPU suite.
# WEIGHTSTREAM_COMMIT must be given (the device checkout's git HEAD lags).
source perf/device/prefix.sh || exit $?
timeout ${FLUX_TIMEOUT:-150} python3 -m perf run --scenario flux-12b-1024 --modes ${FLUX_MODES:-resident,layerwise,graphs} \
  --out "$OUT" --touch-gb 0 2>&1 | tail -7
timeout ${WAN_TIMEOUT:-150} python3 -m perf run --scenario wan-14b-480p --modes ${WAN_MODES:-resident,layerwise} \
  --out "$OUT" --touch-gb 0 2>&1 | tail -6
python3 -m perf check --tolerance 0.01 "$OUT"/*.json 2>&1 | grep -v "not measured" | tail -12
timeout ${GPU_TIMEOUT:-280} python3 -m pytest -q -m gpu -n ${GPU_WORKERS:-4} -p no:cacheprovider --junitxml="$OUT/gpu.xml" \
  ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu.log" | tail -25
