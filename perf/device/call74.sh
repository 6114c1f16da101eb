# h200 (eighteenth session): weight_codec="auto" under DLO AllGather on one GPU (fake group of one:
# tests/test_dlo_auto_codec_gpu.py), the single-process auto codec GPU tests (coded_auto.sample was
# refactored), then the link-free DLO rank proxy with only part of the blocks coded (exp-k: the share a
# rank's plan codes on x2 is ~0.7-0.8 by the planner; 0.5 and 0.75 here). WEIGHTSTREAM_COMMIT must be given. ~400 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_dlo_auto_codec_gpu.py \
  tests/test_auto_codec.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? at $((SECONDS-T0)) s"; tail -15 "$OUT/tests.log" | cut -c1-300
for f in ${FRACTIONS:-0.75 0.5}; do
  timeout ${PROBE_TIMEOUT:-170} python3 perf/probe_dlo_decode.py --modes coded --coded-fraction $f --out "$OUT" \
    > "$OUT/probe-f$f.log" 2>&1
  echo "probe f=$f rc=$? at $((SECONDS-T0)) s"; grep -E "^(resident|raw|coded|graphs)" "$OUT/probe-f$f.log"
  tail -2 "$OUT/probe-f$f.log" | cut -c1-300
done
