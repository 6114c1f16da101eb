# h200, for the next session: what the sixth session left unmeasured (perf/RUNBOOK.md "Still open ... sixth",
# item 1): spread pinned budget, GPU encode, early-drop setup RSS, module-coded arrival, the GPU tests changed
# after 9aef8fd. WEIGHTSTREAM_COMMIT must be given. About 500 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-230} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 70 --out "$OUT" \
  --modes ${FLUX_MODES:-resident-tfill,layerwise,layerwise-pinned-half,layerwise-coded,layerwise-coded-encgpu} \
  > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "median step|set up" "$OUT/flux.log" | cut -c1-170
timeout ${MODULE_TIMEOUT:-130} python3 perf/bench_module.py --no-peer --modes module,module-coded --rounds 2 --out "$OUT" \
  > "$OUT/module.log" 2>&1; echo "module rc=$? at $((SECONDS-T0)) s"; grep -vE "^\[" "$OUT/module.log" | tail -10 | cut -c1-200
timeout ${GPU_TIMEOUT:-120} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_pack_rss.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|passed|failed" "$OUT/gpu.log" | tail -8
