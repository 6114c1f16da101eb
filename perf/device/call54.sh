# x2 (thirteenth session): DLO AllGather coded after 8a317fb (only the decode waits for the slot's release; the gather
# runs during the compute two blocks back) and the final decode kernel: multigpu tests (DLO coded incl. graphs_kp,
# distributed), then bench_dlo resident + coded (exp-k / exp-kp / exp-k2) with rank 0's profile, then 3 slots.
# WEIGHTSTREAM_COMMIT must be given. ~420 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${MULTI_TIMEOUT:-150} python3 -m pytest -q -m multigpu -p no:cacheprovider -rfE tests/test_dlo_coded_gpu.py \
  tests/test_distributed_gpu.py > "$OUT/multigpu.log" 2>&1
echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/multigpu.log" | tail -6
timeout ${DLO_TIMEOUT:-200} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded,dlo-allgather-codedp,dlo-allgather-coded2 \
  --steps 5 --warmup 2 --profile-dir "$OUT/prof2" --out "$OUT" > "$OUT/dlo.log" 2>&1
echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "ms/step|wrote" | tail -5
[ -n "$SKIP_SLOTS3" ] || mkdir -p "$OUT/slots3"
[ -n "$SKIP_SLOTS3" ] && exit 0
timeout ${DLO3_TIMEOUT:-150} python3 perf/bench_dlo.py --modes resident,dlo-allgather-codedp,dlo-allgather-coded --num-slots 3 \
  --steps 5 --warmup 2 --profile-dir "$OUT/prof3" --out "$OUT/slots3" > "$OUT/dlo3.log" 2>&1
echo "dlo slots3 rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo3.log" | grep -E "ms/step" | tail -4
