# h200 (tenth session): after the per-block slot wait (waits_for_free_of) and the tail release: the coded / graph /
# auto-codec GPU tests, then wan-14b-480p layerwise-codedauto again (its plan's measured H2D should now read the
# link, not the slot waits). WEIGHTSTREAM_COMMIT must be given. ~400 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-250} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_auto_codec.py \
  tests/kernels/test_codec.py tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${WAN_TIMEOUT:-300} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 140 --out "$OUT" \
  --modes ${WAN_MODES:-resident-tfill,layerwise-codedauto} > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec" "$OUT/wan.log" | tail -6
