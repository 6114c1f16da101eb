# h200 (eighth session, last call): module offload with exp-k2 (module-coded2 arrivals; target <= 0.75x the uncoded
# floor, exp-k 0.716-0.718 at a758c19). WEIGHTSTREAM_COMMIT must be given. About 120 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${MODULE_TIMEOUT:-170} python3 perf/bench_module.py --no-peer --modes module-coded2 --rounds 2 --out "$OUT" \
  > "$OUT/module.log" 2>&1; echo "module rc=$? at $((SECONDS-T0)) s"; grep -vE "^\[" "$OUT/module.log" | tail -8 | cut -c1-220
