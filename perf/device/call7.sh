# x2, last call of the session: flux perf for issues 14/15 (coded, auto placement vs the best fixed
# count, pinned budget at half the model), then the GPU tests that failed or are new, then the
# multigpu event-log test. WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
timeout ${FLUX_TIMEOUT:-250} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 75 --out "$OUT" \
  --modes ${FLUX_MODES:-resident,layerwise,layerwise-coded,graphs-coded,layerwise-auto-12gb,layerwise-r14,layerwise-pinned-half} \
  2>&1 | grep -vE "^\[[0-9:]+\] " | tail -14
timeout ${GPU_TIMEOUT:-110} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -k "disable_releases or bounce or coded or auto_placement" \
  tests/test_graphs_gpu.py tests/test_bounce_gpu.py tests/test_coded_source_gpu.py tests/test_auto_placement.py \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${MULTI_TIMEOUT:-70} python3 -m pytest -q -m multigpu -p no:cacheprovider \
  "tests/test_distributed_gpu.py::test_nccl_event_log_and_pinned_shards" > "$OUT/multigpu.log" 2>&1
echo "multigpu rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/multigpu.log" | tail -3
