# h200 (tenth session): weight_codec="auto" -- its GPU tests and the coded/graph GPU tests (CodedSource gained raw
# blocks), then flux-12b-1024 layerwise-codedauto / graphs-codedauto against resident-tfill. WEIGHTSTREAM_COMMIT
# must be given. ~480 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-270} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_auto_codec.py \
  tests/kernels/test_codec.py tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-300} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 110 --out "$OUT" \
  --modes resident-tfill,layerwise-codedauto,graphs-codedauto > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| |auto codec" "$OUT/flux.log" | tail -8
