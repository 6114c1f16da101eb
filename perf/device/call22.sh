# x2 (eighth session, last): the search-free decode (per-tile segment map): codec GPU tests, decode GB/s (exp-k,
# exp-k2), 2x DLO AllGather coded and its multigpu tests, flux coded (exp-k2 eager, exp-k graphs) again.
# WEIGHTSTREAM_COMMIT must be given. About 350 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${CODEC_TIMEOUT:-50} python3 perf/bench_codec.py --sizes double --fills student-t --codec exp-k exp-k2 \
  --planes gather --no-build --no-graph --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "decode .* ms" "$OUT/codec.log" | sed -E 's/; copy.*//' | cut -c1-160
timeout ${DLO_TIMEOUT:-80} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded --steps 5 --warmup 2 \
  --out "$OUT" > "$OUT/dlo.log" 2>&1; echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "ms/step" | tail -2
timeout ${MULTI_TIMEOUT:-60} python3 -m pytest -q -m multigpu -p no:cacheprovider tests/test_dlo_coded_gpu.py \
  > "$OUT/multigpu.log" 2>&1; echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|passed|failed" "$OUT/multigpu.log" | tail -4
timeout ${FLUX_TIMEOUT:-170} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 55 --out "$OUT" \
  --modes resident-tfill,layerwise-coded2,graphs-coded > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -3
