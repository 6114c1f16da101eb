# h200 (ninth session): the coded ring's stream pattern without a model (bench_coded_ring), eager vs graph,
# decode on its own stream / the copy stream / the compute stream, and copies only. WEIGHTSTREAM_COMMIT must be given. ~90 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${RING_TIMEOUT:-60} python3 perf/bench_coded_ring.py --out "$OUT" > "$OUT/ring.log" 2>&1
echo "ring rc=$? at $((SECONDS-T0)) s"; grep -E "^\s+\[|Error|error" "$OUT/ring.log" | tail -8
timeout ${RING_TIMEOUT:-60} python3 perf/bench_coded_ring.py --mb 512 --gemm-n 2 --out "$OUT/b" > "$OUT/ring2.log" 2>&1
echo "ring2 rc=$? at $((SECONDS-T0)) s"; grep -E "^\s+\[|Error|error" "$OUT/ring2.log" | tail -8
