# h200: flux coded again after 9e44d75 (hugepage coded arena), one traced coded run, then module-coded.
# WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-130} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 60 --out "$OUT" \
  --modes resident-tfill,layerwise-coded,graphs-coded > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "median step|set up" "$OUT/flux.log" | cut -c1-160
timeout ${MODULE_TIMEOUT:-150} python3 perf/bench_module.py --no-peer --modes module,module-coded --rounds 3 --out "$OUT" \
  > "$OUT/module.log" 2>&1; echo "module rc=$? at $((SECONDS-T0)) s"; grep -vE "^\[" "$OUT/module.log" | tail -14 | cut -c1-200
timeout ${TRACE_TIMEOUT:-60} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 55 --out "$OUT/traced" \
  --trace-dir "$OUT/trace" --modes layerwise-coded > "$OUT/trace.log" 2>&1
echo "trace rc=$? at $((SECONDS-T0)) s"; ls -la "$OUT/trace" 2>/dev/null | head -5
