# h200 (fourteenth session, last): the whole `-m gpu` suite on ELEM_CHUNK 512 (verbose: a timeout still shows which
# ran), then (WAN=1) wan-14b-480p resident-tfill + layerwise-coded (exp-k decodes 1401 GB/s now, 1196 at call55).
# SKIP_SUITE=1 skips the suite. WEIGHTSTREAM_COMMIT must be given. ~350 s (~560 s with WAN=1).
source perf/device/prefix.sh || exit $?
T0=$SECONDS
if [ -z "$SKIP_SUITE" ]; then
  timeout ${GPU_TIMEOUT:-330} python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfEs tests > "$OUT/gpu.log" 2>&1
  echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
  grep -c PASSED "$OUT/gpu.log"; grep -E "SKIPPED" "$OUT/gpu.log" | tail -3
fi
[ -n "$WAN" ] || exit 0
timeout ${WAN_TIMEOUT:-215} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --modes resident-tfill,layerwise-coded > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -4
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/wan-*.json"):
    for k, m in json.load(open(f))["modes"].items():
        print(k, m["step_ms"], m.get("ratio_to_resident_tfill"), m.get("output_equals_resident"))
PY
