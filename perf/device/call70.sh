# h200 (seventeenth session): one-GPU proxy of a coded DLO rank's on-device work (perf/probe_dlo_decode.py):
# flux-12b-1024 layerwise with the block store moved to device memory (no host link), raw vs exp-k / exp-k2,
# eager and graphs, with kernel profiles. x2 was not lent. WEIGHTSTREAM_COMMIT must be given. ~300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${PROBE_TIMEOUT:-480} python3 perf/probe_dlo_decode.py --modes ${MODES:-raw,coded,coded2,graphs-raw,graphs-coded} \
  --profile-dir "$OUT/prof" --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe rc=$? at $((SECONDS-T0)) s"; grep -v "coding\|packing" "$OUT/probe.log" | tail -c 4000
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/dlodecode-*.json"):
    r = json.load(open(f))
    for k, m in r["modes"].items():
        cls = (m.get("profile") or {}).get("kernel_totals", {}).get("classes", {})
        print(k, m["step_ms"], m["ratio_to_resident"], m["bit_exact"], {c: v["ms"] for c, v in cls.items()})
PY
