# h200 (fifteenth session): the one GPU test call61 did not finish (module coded, 16384-element tiles, exp-k2; 91 s
# alone in call52), then flux-12b-1024 on ELEM_CHUNK 512: resident-tfill (bit-exact reference), layerwise-coded,
# layerwise-coded2, graphs-coded, graphs-coded2. WEIGHTSTREAM_COMMIT must be given. ~450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-150} python3 -m pytest -v -p no:cacheprovider -rfEs --durations=3 \
  "tests/test_module_coded.py::test_gpu_bit_exact_with_triton_decode[True-16384-exp-k2]" > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed|s call" "$OUT/gpu.log" | tail -5
timeout ${FLUX_TIMEOUT:-400} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --modes resident-tfill,layerwise-coded,layerwise-coded2,graphs-coded,graphs-coded2 > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |bit-exact|bit_exact" "$OUT/flux.log" | tail -8
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/flux-*.json"):
    for k, m in json.load(open(f))["modes"].items():
        print(k, m["step_ms"], m.get("ratio_to_floor"), m.get("output_equals_resident"))
PY
