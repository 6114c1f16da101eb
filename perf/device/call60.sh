# h200 (fourteenth session): the 22 GPU tests call59's 330 s limit did not reach (listed in call60-tests.txt:
# trust exec/save, coded source encode-on-device k2, module coded 16384 tiles). WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-240} python3 -m pytest -v -n 8 -p no:cacheprovider -rfEs $(cat perf/device/call60-tests.txt) \
  > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
