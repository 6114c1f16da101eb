# h200 (seventeenth session): the link-free DLO rank proxy with exp-kp (the decode that cost least beside Flux in
# call72), eager and graphs, with profiles. WEIGHTSTREAM_COMMIT must be given. ~150 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${PROBE_TIMEOUT:-240} python3 perf/probe_dlo_decode.py --modes codedp,graphs-codedp --profile-dir "$OUT/prof" \
  --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe rc=$? at $((SECONDS-T0)) s"; grep -E "^(resident|raw|coded|graphs)" "$OUT/probe.log"; tail -3 "$OUT/probe.log" | cut -c1-400
