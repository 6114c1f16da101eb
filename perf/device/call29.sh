# h200 (ninth session): the productised decode placement (graphs: decode at use, on the compute stream;
# eager: at load, on the decode stream): the coded / graph GPU tests, then flux graphs-coded (exp-k, exp-k2)
# against resident-tfill. WEIGHTSTREAM_COMMIT must be given. ~380 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-260} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-170} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 55 --out "$OUT" \
  --modes resident-tfill,graphs-coded,graphs-coded2 > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -4
