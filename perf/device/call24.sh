# h200 (ninth session, first): the GPU tests changed after call22 (the word path's fallback for buffers off
# alignment, byte-wise level-2 base loads; never run on a GPU) with the other coded GPU tests; then the graph
# copy rate by host memory kind (cudaHostAlloc / registered 4 KB pages / registered huge pages) and beside the
# decode kernel; then flux coded eager and graphs with the coded arena on huge pages.
# WEIGHTSTREAM_COMMIT must be given. ~450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-200} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${COPY_TIMEOUT:-80} python3 perf/bench_graph_copy.py --chunks 1 --host pinned reg-4k reg-huge --out "$OUT" \
  > "$OUT/graphcopy.log" 2>&1; echo "graphcopy rc=$? at $((SECONDS-T0)) s"; grep -E "GB/s|Error|error" "$OUT/graphcopy.log" | tail -26
timeout ${FLUX_TIMEOUT:-170} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 55 --out "$OUT" \
  --modes resident-tfill,layerwise-coded,graphs-coded > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -4
