# h200 (ninth session): bench_decode_steal as kept (launch options instead of the reverted persistent grid).
# WEIGHTSTREAM_COMMIT must be given. ~60 s.
source perf/device/prefix.sh || exit $?
timeout ${STEAL_TIMEOUT:-80} python3 perf/bench_decode_steal.py --num-warps 8 4 --words on off --out "$OUT" > "$OUT/steal.log" 2>&1
echo "steal rc=$?"; grep -E "^\s+\[|Error|error|wrote" "$OUT/steal.log" | tail -6
