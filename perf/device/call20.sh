# x2 (eighth session): the word path for exp-k2 (0b…: decode GB/s, flux layerwise-coded2 / graphs-coded2, codec GPU
# tests), flux layerwise-coded again, the H2D copy rate beside D2D copies (HBM load), and 2x DLO AllGather coded with
# NCCL limited to 4 / 8 channels (its kernels share the SMs with compute and decode). WEIGHTSTREAM_COMMIT must be
# given. About 480 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${CODEC_TIMEOUT:-60} python3 perf/bench_codec.py --sizes double --fills student-t --codec exp-k exp-k2 \
  --planes gather --words on off --no-build --no-graph --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "decode .* ms" "$OUT/codec.log" | sed -E 's/; copy.*//' | cut -c1-160
timeout ${COPY_TIMEOUT:-60} python3 perf/bench_graph_copy.py --chunks 1 --out "$OUT" > "$OUT/graphcopy.log" 2>&1
echo "graphcopy rc=$? at $((SECONDS-T0)) s"; grep -E "GB/s" "$OUT/graphcopy.log"
for ch in 4 8; do
  mkdir -p "$OUT/ch$ch"
  NCCL_MAX_NCHANNELS=$ch timeout ${DLO_TIMEOUT:-80} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded --steps 5 \
    --warmup 2 --out "$OUT/ch$ch" > "$OUT/dlo-ch$ch.log" 2>&1; echo "dlo ch$ch rc=$? at $((SECONDS-T0)) s"
  grep -v "^\[rank" "$OUT/dlo-ch$ch.log" | grep -E "ms/step" | tail -2
done
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 60 --out "$OUT" \
  --modes resident-tfill,layerwise-coded2,graphs-coded2,layerwise-coded > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -4
