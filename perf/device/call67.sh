# h200 (sixteenth session): flux-12b-1024 exp-k and exp-kp modes on the runtime chunk loop (call63 ran only exp-k2):
# resident-tfill, layerwise-coded, graphs-coded, layerwise-codedp, graphs-codedp. WEIGHTSTREAM_COMMIT must be given.
# ~400 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-480} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --modes resident-tfill,layerwise-coded,graphs-coded,layerwise-codedp,graphs-codedp > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/flux.log" | tail -7
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/flux-*.json"):
    for k, m in json.load(open(f))["modes"].items():
        print(k, m["step_ms"], m.get("ratio_to_floor"), m.get("output_equals_resident"))
PY
