# h200 (eleventh session): weight_codec="auto" against `none` in one run -- flux-12b-1024 layerwise, layerwise-codedauto,
# graphs, graphs-codedauto: auto_excess_s (planning + coding steps over as many uncoded steps) and auto_payoff_steps
# (perf.results.compare_auto_codec). WEIGHTSTREAM_COMMIT must be given. ~260 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${FLUX_TIMEOUT:-330} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 150 --out "$OUT" \
  --modes layerwise,layerwise-codedauto,graphs,graphs-codedauto > "$OUT/flux.log" 2>&1
echo "flux rc=$? at $((SECONDS-T0)) s"; grep -E "^\| |auto codec: code" "$OUT/flux.log" | tail -10
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/*-nvidia-h200-*.json')):
    d=json.load(open(f))
    for m, r in d['modes'].items():
        if 'auto_excess_s' in r or 'coding_s' in r:
            print(m, 'step', r['step_ms'], 'excess_s', r.get('auto_excess_s'), 'payoff_steps', r.get('auto_payoff_steps'),
                  'coding_s', r.get('coding_s'), 'steps', len(r.get('coding_step_ms_all') or []), 'first', r.get('first_step_ms'))"
