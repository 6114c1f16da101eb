# h200 (eleventh session, first): the GPU tests of the commits after call38 (re-planning at a new signature now
# on CUDA, the refusals, the coded_auto / codec_names split) with the coded / graph / layerwise suites, then
# flux-12b-1024 layerwise-codedauto for the planning step's parts (plan_parts_s). WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-270} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_codec.py \
  tests/kernels/test_codec.py tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_graphs_gpu.py tests/test_layerwise_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes layerwise-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec|planned and coded" "$OUT/flux.log" | tail -8
python3 -c "
import json,glob; d=json.load(open(glob.glob('$OUT/flux-12b-1024-*.json')[0])); f=d['modes']['layerwise-codedauto']
p=f.get('codec_plan', {}); print('plan_s', p.get('plan_s'), p.get('plan_parts_s'), 'first_step_ms', f.get('first_step_ms'))
print('coding', f.get('coding_s'), 's over', len(f.get('coding_step_ms_all', [])), 'steps:', f.get('coding_step_ms_all'))"
