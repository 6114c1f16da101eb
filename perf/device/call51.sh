# h200 (twelfth session, last): the final tree -- chunked element path, 4 warps by default, exp-kp. GPU tests: auto
# codec, codec kernels (v1/v2/v3), coded source, mmap coded, module coded, graphs, layerwise. Then wan-14b-480p
# resident, layerwise-coded, layerwise-codedp in one run. WEIGHTSTREAM_COMMIT must be given. ~420 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-230} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_codec.py \
  tests/kernels/test_codec.py tests/kernels/test_codec_v3.py tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py \
  tests/test_module_coded.py tests/test_graphs_gpu.py tests/test_layerwise_gpu.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${WAN_TIMEOUT:-230} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 110 --out "$OUT" \
  --modes resident,layerwise-coded,layerwise-codedp > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -5
