# h200 (fifteenth session): the element path's chunk loop is a runtime loop (compiles 4-8x faster). bench_codec
# exp-k / exp-k2 / exp-kp at 4 warps (against call58's 1401.3 / 825.4 / 1947.5 unrolled), the codec kernel GPU
# tests + the module-coded exp-k2 16384-tile test, then flux-12b-1024 resident-tfill, layerwise-coded2,
# graphs-coded2 (call62's exp-k2 modes did not finish). WEIGHTSTREAM_COMMIT must be given. ~480 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${CODEC_TIMEOUT:-130} python3 perf/bench_codec.py --sizes double single --fills student-t \
  --codec exp-k exp-k2 exp-kp --num-warps 4 --planes gather --no-build --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "\] decode" "$OUT/codec.log"
timeout ${GPU_TIMEOUT:-150} python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfEs --durations=5 tests/kernels \
  "tests/test_module_coded.py::test_gpu_bit_exact_with_triton_decode" > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed|s call" "$OUT/gpu.log" | tail -10
timeout ${FLUX_TIMEOUT:-210} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --modes resident-tfill,layerwise-coded2,graphs-coded2 > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/flux.log" | tail -5
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/flux-*.json"):
    for k, m in json.load(open(f))["modes"].items():
        print(k, m["step_ms"], m.get("ratio_to_floor"), m.get("output_equals_resident"))
PY
