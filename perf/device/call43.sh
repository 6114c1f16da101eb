# h200 (eleventh session, last): the final tree's GPU tests -- auto codec (the capture invariant rewritten, the
# background pin failure), codec kernels, coded source, mmap coded, module coded (BlockRegistration moved to
# host_memory), graphs (eager-settling), layerwise. WEIGHTSTREAM_COMMIT must be given. ~220 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-300} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_codec.py \
  tests/kernels/test_codec.py tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py tests/test_layerwise_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
