# h200 (ninth session): bench_coded_ring with 4-byte memset nodes among the GEMMs (the flux graph has ~7 per
# block, cuBLAS zeroing stream-K flags; the ring without them did not reproduce graphs-coded's slow copies,
# call25). WEIGHTSTREAM_COMMIT must be given. ~80 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
for m in 0 8; do
  timeout ${RING_TIMEOUT:-60} python3 perf/bench_coded_ring.py --mb 512 --gemm-n 2 --memsets $m --out "$OUT" > "$OUT/ring-m$m.log" 2>&1
  echo "ring memsets=$m rc=$? at $((SECONDS-T0)) s"; grep -E "^\s+\[|Error|error" "$OUT/ring-m$m.log" | tail -8
done
