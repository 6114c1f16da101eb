# h200 (seventeenth session): why call70's link-free ring is 1.075x (raw) / 1.156x (exp-k) resident:
# the D2D copy rate alone and beside GEMMs (probe_d2d_copy.py), then probe_dlo_decode raw/coded at 2 slots
# with resident's profile and the kept traces, and at 3 slots. WEIGHTSTREAM_COMMIT must be given. ~300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 60 python3 perf/device/probe_d2d_copy.py 2>&1 | tee "$OUT/d2d.log"
timeout ${PROBE_TIMEOUT:-240} python3 perf/probe_dlo_decode.py --modes raw,coded --profile-dir "$OUT/prof" --keep-trace \
  --out "$OUT" > "$OUT/probe-s2.log" 2>&1
echo "probe s2 rc=$? at $((SECONDS-T0)) s"; grep -E "^(resident|raw|coded)" "$OUT/probe-s2.log"
timeout ${PROBE_TIMEOUT:-240} python3 perf/probe_dlo_decode.py --modes raw,coded,coded2 --num-slots 3 --out "$OUT" \
  > "$OUT/probe-s3.log" 2>&1
echo "probe s3 rc=$? at $((SECONDS-T0)) s"; grep -E "^(resident|raw|coded)" "$OUT/probe-s3.log"; tail -5 "$OUT/probe-s3.log"
