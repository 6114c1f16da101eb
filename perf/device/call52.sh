# h200 (thirteenth session, first): the whole `-m gpu` suite (185 tests) on the final kernel of the twelfth session,
# incl. the codec/graph tests call51 did not reach and test_gpu_graph_replays_a_table_reencoded_into_another_version.
# Verbose, so a timeout still shows which ran. WEIGHTSTREAM_COMMIT must be given. ~500 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-540} python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider -rfEs --durations=25 tests \
  > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
grep -c PASSED "$OUT/gpu.log"; grep -E "SKIPPED" "$OUT/gpu.log" | tail -5
