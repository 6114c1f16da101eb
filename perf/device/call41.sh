# h200 (eleventh session): the sampled plan's decode now timed from a CUDA graph (call40 read exp-k at 501 GB/s
# eager-timed). auto-codec GPU tests, then flux-12b-1024 layerwise-codedauto + graphs-codedauto, then wan-14b-480p
# resident-tfill + layerwise-codedauto. WEIGHTSTREAM_COMMIT must be given. ~450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-150} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_auto_codec.py \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes layerwise-codedauto,graphs-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec: code|planned and coded" "$OUT/flux.log" | tail -8
timeout ${WAN_TIMEOUT:-220} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 140 --out "$OUT" \
  --modes resident-tfill,layerwise-codedauto > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec: code" "$OUT/wan.log" | tail -6
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/*-nvidia-h200-*.json')):
    d=json.load(open(f))
    for m, r in d['modes'].items():
        p=r.get('codec_plan') or {}
        if p: print(f.split('/')[-1], m, 'plan_s', p.get('plan_s'), p.get('plan_parts_s'), 'decode_gbps', p.get('decode_gbps'),
                    'first_step_ms', r.get('first_step_ms'), 'coding_s', r.get('coding_s'), 'steps', len(r.get('coding_step_ms_all') or []),
                    'max step', max(r.get('coding_step_ms_all') or [0]))"
