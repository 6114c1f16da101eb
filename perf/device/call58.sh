# h200 (fourteenth session): ELEM_CHUNK 512 (calls 56-57). The codec GPU tests (kernels, coded source, mmap coded,
# module coded, auto codec), then bench_codec exp-k / exp-k2 / exp-kp at 4 warps (Student-t double and single
# blocks) against call50's 1196 / 719 / 1731. WEIGHTSTREAM_COMMIT must be given. ~330 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 230 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rfEs tests/kernels tests/test_coded_source_gpu.py \
  tests/test_mmap_coded_gpu.py tests/test_module_coded.py tests/test_auto_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|^SKIPPED|passed|failed" "$OUT/gpu.log" | tail -12
timeout 150 python3 perf/bench_codec.py --sizes double single --fills student-t --codec exp-k exp-k2 exp-kp --num-warps 4 \
  --planes gather --no-build --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "\] decode" "$OUT/codec.log"
