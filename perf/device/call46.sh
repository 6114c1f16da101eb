# h200 (twelfth session): codec version 3 ("exp-kp", escapes patched after the tile). GPU tests of the codec kernels
# (v1/v2/v3), the coded source (the *_kp cases), module coded; bench_codec exp-k vs exp-kp (Student-t single and
# double blocks); bench_decode_steal exp-k vs exp-kp; flux-12b-1024 layerwise-codedp. WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 240 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec_v3.py tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_module_coded.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
timeout 100 python3 perf/bench_codec.py --sizes single double --fills student-t --codec exp-k exp-kp --no-build \
  --out "$OUT" > "$OUT/codec.log" 2>&1; echo "codec rc=$? at $((SECONDS-T0)) s"; grep -iE "GB/s|decode" "$OUT/codec.log" | tail -8
timeout 90 python3 perf/bench_decode_steal.py --codec exp-k exp-kp --reps 9 --out "$OUT" > "$OUT/steal.log" 2>&1
echo "steal rc=$? at $((SECONDS-T0)) s"; tail -4 "$OUT/steal.log"
timeout 150 python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 130 --out "$OUT" \
  --modes layerwise-codedp > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/flux.log" | tail -4
