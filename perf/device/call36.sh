# h200 (tenth session): weight_codec="auto" codes eagerly in the background (the steps stream raw blocks until each
# is stored at a step start): the auto-codec / coded-source GPU tests, then flux-12b-1024 layerwise-codedauto and
# graphs-codedauto (graphs code at once before the capture) against resident-tfill; the worker steps until the
# coding finished (coding_step_ms_all: the raw-to-coded switch), then times. WEIGHTSTREAM_COMMIT must be given. ~420 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-150} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_auto_codec.py \
  tests/test_coded_source_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -6
timeout ${FLUX_TIMEOUT:-300} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 110 --out "$OUT" \
  --modes resident-tfill,layerwise-codedauto,graphs-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec" "$OUT/flux.log" | tail -8
