# h200 (thirteenth session): wan-14b-480p on the final kernel with the bit-exact reference call51 lacked: resident,
# resident-tfill, layerwise-coded (exp-k), layerwise-codedp (exp-kp) in one run. WEIGHTSTREAM_COMMIT must be given. ~300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${WAN_TIMEOUT:-330} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 110 --out "$OUT" \
  --modes resident,resident-tfill,layerwise-coded,layerwise-codedp > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -6
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/wan-*.json"):
    for k, m in json.load(open(f))["modes"].items():
        print(k, m["step_ms"], m.get("ratio_to_resident"), m.get("ratio_to_resident_tfill"), m.get("output_equals_resident"))
PY
