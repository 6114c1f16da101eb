# h200 (twelfth session): the element path decodes a tile 1024 elements at a time (fewer live registers beside the
# word path; call49's words-only probe ran 1.5-2x the one-launch kernel). Codec kernel GPU tests, then bench_codec
# exp-k / exp-k2 / exp-kp at 8 and 4 warps (Student-t double and single blocks). ~150 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec_v3.py tests/kernels/test_codec.py \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout 150 python3 perf/bench_codec.py --sizes double single --fills student-t --codec exp-k exp-k2 exp-kp --num-warps 8 4 \
  --planes gather --no-build --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "\] decode" "$OUT/codec.log"
