# h200 (tenth session): the background coding with half the cores encoding and at most 2 blocks stored per step
# start: the auto-codec GPU tests, then flux-12b-1024 layerwise-codedauto alone (coding_step_ms_all: do the steps
# during the job stay near the raw 0.43 s?). WEIGHTSTREAM_COMMIT must be given. ~250 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-120} python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider tests/test_auto_codec.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -6
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes layerwise-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec|planned and coded" "$OUT/flux.log" | tail -8
python3 -c "
import json,glob; d=json.load(open(glob.glob('$OUT/flux-12b-1024-*.json')[0])); f=d['modes']['layerwise-codedauto']
print('coding', f.get('coding_s'), 's over', len(f.get('coding_step_ms_all', [])), 'steps:', f.get('coding_step_ms_all'))"
