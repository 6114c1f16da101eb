# h200 (seventeenth session): where in a Flux block a decode beside compute costs least
# (perf/probe_decode_placement.py: start / attn / mlp, exp-k and exp-kp). WEIGHTSTREAM_COMMIT must be given. ~150 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
for c in ${CODECS:-exp-k exp-kp}; do
  timeout ${PLACE_TIMEOUT:-150} python3 perf/probe_decode_placement.py --codec $c --placements start,attn,mlp --out "$OUT" \
    > "$OUT/place-$c.log" 2>&1
  echo "place $c rc=$? at $((SECONDS-T0)) s"; grep -E "^(resident|start|attn|mlp)" "$OUT/place-$c.log"; tail -3 "$OUT/place-$c.log"
done
