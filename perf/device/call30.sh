# h200 (ninth session, last): the GPU tests outside the coded set (the executor now calls source.before_use
# before every streamed block; a no-op for the pinned, mmap and DLO sources). WEIGHTSTREAM_COMMIT must be given. ~400 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-420} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_placement.py \
  tests/test_compile_gpu.py tests/test_discovery_diffusers.py tests/test_happens_before.py tests/test_inplace_gpu.py \
  tests/test_layerwise_gpu.py tests/test_mmap_source_gpu.py tests/test_module_offload_gpu.py tests/test_pack_rss.py \
  tests/test_planner.py tests/test_skip_blocks.py tests/test_trust_exec_gpu.py tests/test_trust_save_gpu.py \
  tests/kernels/test_materialise.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -12
