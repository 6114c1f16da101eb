# h200 (eleventh session): weight_codec="auto" under CUDA graphs now codes in the background (eager-settling steps,
# capture after the job). GPU tests: auto codec, graphs, coded source; then flux-12b-1024 graphs-codedauto and
# layerwise-codedauto (coding_step_ms_all). WEIGHTSTREAM_COMMIT must be given. ~300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-200} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_auto_codec.py \
  tests/test_graphs_gpu.py tests/test_coded_source_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-230} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes graphs-codedauto,layerwise-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec: code|planned and coded" "$OUT/flux.log" | tail -8
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/*-nvidia-h200-*.json')):
    d=json.load(open(f))
    for m, r in d['modes'].items():
        p=r.get('codec_plan') or {}
        if p: print(m, 'plan_s', p.get('plan_s'), p.get('plan_parts_s'), 'decode_gbps', p.get('decode_gbps'),
                    'coding_s', r.get('coding_s'), 'steps', [round(x) for x in r.get('coding_step_ms_all') or []])"
