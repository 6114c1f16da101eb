# h200, for the next session: the GPU tests refactored after call17 (a19c34e), exp-k2 under CUDA graphs, and wan
# with exp-k after the LEVEL2 split (1.011x at c99ccf1). WEIGHTSTREAM_COMMIT must be given. About 330 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${FLUX_TIMEOUT:-110} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 75 --out "$OUT" \
  --modes resident-tfill,graphs-coded2 > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -2
timeout ${WAN_TIMEOUT:-190} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 92 --out "$OUT" \
  --modes resident-tfill,layerwise-coded > "$OUT/wan.log" 2>&1; echo "wan rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/wan.log" | tail -2
