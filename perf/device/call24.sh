# h200, for the next session: the GPU tests changed after call22 (the word path's fallback for buffers off
# alignment, byte-wise level-2 base loads; never run on a GPU) with the other coded GPU tests. WEIGHTSTREAM_COMMIT must be given. ~200 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-240} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
