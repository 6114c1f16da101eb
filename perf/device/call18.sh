# h200 (eighth session): the four-elements-per-word decode path (d01acae): codec GPU tests (the word-path test and
# the refactored ones of a19c34e), decode GB/s with the word path on / off and 8 / 4 warps, then flux coded
# (eager and graphs; targets <= 0.75 x the uncoded floor) and wan coded (target <= 1.01 x resident-tfill).
# WEIGHTSTREAM_COMMIT must be given. About 480 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${CODEC_TIMEOUT:-70} python3 perf/bench_codec.py --sizes double --fills student-t --codec exp-k exp-k2 \
  --planes gather --words on off --num-warps 8 4 --no-build --no-graph --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "decode .* ms" "$OUT/codec.log" | sed -E 's/; copy.*//' | cut -c1-160
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 60 --out "$OUT" \
  --modes resident-tfill,layerwise-coded,graphs-coded > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -3
timeout ${WAN_TIMEOUT:-190} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 92 --out "$OUT" \
  --modes resident-tfill,layerwise-coded > "$OUT/wan.log" 2>&1; echo "wan rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/wan.log" | tail -2
