# h200 (seventh session): the coded sidecar at Flux scale (issue 14's setup target: a coded sidecar loads at
# <= 0.05 s/GB). The harness writes the checkpoint first (~50 s), -mmap-coded encodes it and writes the sidecar,
# -mmap-coded-sidecar maps and pins it. WEIGHTSTREAM_COMMIT must be given. About 300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${MMAP_TIMEOUT:-480} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 220 --out "$OUT" \
  --modes layerwise-mmap-coded,layerwise-mmap-coded-sidecar > "$OUT/mmap.log" 2>&1
echo "mmap rc=$? at $((SECONDS-T0)) s"; tr '\r' '\n' < "$OUT/mmap.log" | grep -vE "it/s|B/s\]|written \(" | tail -30 | cut -c1-260
df -h /tmp | tail -1
