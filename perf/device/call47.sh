# h200 (twelfth session): exp-kp with the unranked (lean) kernel for tables without ranked escapes. GPU tests of
# the codec kernels (v1/v2/v3) and the coded source's *_kp cases; bench_codec exp-k vs exp-kp; bench_decode_steal;
# wan-14b-480p resident, resident-tfill, layerwise-coded, layerwise-codedp in one run. WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec_v3.py tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py -k "v3 or kp or gpu_decode or word_path" > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
timeout 80 python3 perf/bench_codec.py --sizes single double --fills student-t --codec exp-k exp-kp --no-build \
  --out "$OUT" > "$OUT/codec.log" 2>&1; echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "\] decode" "$OUT/codec.log" | tail -8
timeout 60 python3 perf/bench_decode_steal.py --codec exp-k exp-kp --reps 9 --out "$OUT" > "$OUT/steal.log" 2>&1
echo "steal rc=$? at $((SECONDS-T0)) s"; tail -3 "$OUT/steal.log"
timeout 330 python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 120 --out "$OUT" \
  --modes resident,resident-tfill,layerwise-coded,layerwise-codedp > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -6
