# h200: issue 14/15 after 470ef47..def809b (coded copies run ahead, spread pinned budget, 8 Mi encode
# chunks): flux coded + half-pinned, wan coded, the coded sidecar pair, codec kernel/build rates.
# WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-185} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 90 --out "$OUT" \
  --modes ${FLUX_MODES:-resident-tfill,layerwise,layerwise-coded,graphs-coded,layerwise-pinned-half} \
  > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/flux.log" | tail -8
grep -E "coding 57 blocks.*100%" "$OUT/flux.log" | sed 's/.*\r//' | head -2
timeout ${WAN_TIMEOUT:-160} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --modes ${WAN_MODES:-resident-tfill,layerwise-coded} > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -4
timeout ${CODEC_TIMEOUT:-50} python3 perf/bench_codec.py --sizes tensor double --fills student-t --planes gather \
  --build-workers 1 4 16 --build-reps 1 --build-blocks 32 --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "GB/s" "$OUT/codec.log" | cut -c1-220 | tail -9
timeout ${MMAP_TIMEOUT:-150} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 100 --out "$OUT" \
  --merge --modes layerwise-mmap-coded,layerwise-mmap-coded-sidecar > "$OUT/mmap.log" 2>&1
echo "mmap rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |sidecar" "$OUT/mmap.log" | cut -c1-250 | tail -6
