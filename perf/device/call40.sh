# h200 (eleventh session): background blocks swapped in at a step start (prepared and pinned on the job thread),
# sampled planning (64 MB per layout): the auto-codec and coded GPU tests, then flux-12b-1024 layerwise-codedauto
# (plan_parts_s, coding_step_ms_all: steps during the job). WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-270} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_codec.py tests/test_coded_source_gpu.py \
  tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes layerwise-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec|planned and coded" "$OUT/flux.log" | tail -8
python3 -c "
import json,glob; d=json.load(open(glob.glob('$OUT/flux-12b-1024-*.json')[0])); f=d['modes']['layerwise-codedauto']
p=f.get('codec_plan', {}); print('plan_s', p.get('plan_s'), p.get('plan_parts_s'), 'first_step_ms', f.get('first_step_ms'))
print('coding', f.get('coding_s'), 's over', len(f.get('coding_step_ms_all', [])), 'steps:', f.get('coding_step_ms_all'))"
