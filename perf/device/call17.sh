# h200 (seventh session, last): exp-k decode rate and flux step back with the level-2 code compiled only for
# version-2 tables (14aa45f had exp-k at 306 GB/s); exp-k2 again; the codec GPU tests. WEIGHTSTREAM_COMMIT must be
# given. About 140 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${CODEC_TIMEOUT:-50} python3 perf/bench_codec.py --sizes double --fills student-t --codec exp-k exp-k2 \
  --planes gather --no-build --no-graph --out "$OUT" > "$OUT/codec.log" 2>&1; echo "codec rc=$? at $((SECONDS-T0)) s"
grep -E "decode .* ms" "$OUT/codec.log" | sed -E 's/; copy.*//' | cut -c1-160
timeout ${GPU_TIMEOUT:-60} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${FLUX_TIMEOUT:-85} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 60 --out "$OUT" \
  --modes resident-tfill,layerwise-coded > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -2
