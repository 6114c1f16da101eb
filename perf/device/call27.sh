# h200 (ninth session): the persistent decode grid (DecodeTable(ctas=)): its GPU tests, decode GB/s and how much
# of a GEMM loop's time a decode beside it steals, by grid. WEIGHTSTREAM_COMMIT must be given. ~100 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_codec.py -k "persistent or word_path" \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${STEAL_TIMEOUT:-120} python3 perf/bench_decode_steal.py --out "$OUT" > "$OUT/steal.log" 2>&1
echo "steal rc=$? at $((SECONDS-T0)) s"; grep -E "^\s+\[|Error|error" "$OUT/steal.log" | tail -10
timeout ${STEAL_TIMEOUT:-120} python3 perf/bench_decode_steal.py --mb 170 --gemm-ms 5 --ctas 0 132 33 8 --out "$OUT/b" > "$OUT/steal2.log" 2>&1
echo "steal2 rc=$? at $((SECONDS-T0)) s"; grep -E "^\s+\[|Error|error" "$OUT/steal2.log" | tail -6
