# x2 (eighth session): every coded GPU test with the word path on by default (single GPU: codec, coded source,
# bounce, mmap coded, module coded, graphs; multigpu: DLO coded), and wan coded again (the second
# measurement against resident-tfill, 1.0058x at 43c277b). WEIGHTSTREAM_COMMIT must be given. About 450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-240} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${MULTI_TIMEOUT:-80} python3 -m pytest -q -m multigpu -p no:cacheprovider tests/test_dlo_coded_gpu.py \
  > "$OUT/multigpu.log" 2>&1; echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|passed|failed" "$OUT/multigpu.log" | tail -4
timeout ${WAN_TIMEOUT:-190} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 92 --out "$OUT" \
  --modes resident-tfill,layerwise-coded > "$OUT/wan.log" 2>&1; echo "wan rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/wan.log" | tail -3
