# x2 (eighteenth session; the first call when x2 is lent): the multigpu DLO coded + distributed tests (now with the
# weight_codec="auto" cases), then bench_dlo resident + dlo-allgather (raw, to read the link) + -coded (exp-k,
# every block) + -codedauto (auto: the ranks plan together and code only what the link needs) with rank 0's
# profile, then -codedp. WEIGHTSTREAM_COMMIT must be given. ~400-500 s; the later parts are skipped when their
# time is not left.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
left() { [ $((SECONDS - T0)) -lt "$1" ]; }
timeout ${MULTI_TIMEOUT:-170} python3 -m pytest -q -m multigpu -p no:cacheprovider -rfE tests/test_dlo_coded_gpu.py \
  tests/test_distributed_gpu.py > "$OUT/multigpu.log" 2>&1
echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/multigpu.log" | tail -6
timeout ${DLO_TIMEOUT:-260} python3 perf/bench_dlo.py --modes resident,dlo-allgather,dlo-allgather-coded,dlo-allgather-codedauto \
  --steps 5 --warmup 2 --profile-dir "$OUT/prof" --out "$OUT" > "$OUT/dlo.log" 2>&1
echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "ms/step|wrote|auto codec" | tail -6
grep -E "ms/step" "$OUT/dlo.log" | grep "rank 0\]" | tail -6
left 470 || exit 0
mkdir -p "$OUT/kp"
timeout 80 python3 perf/bench_dlo.py --modes resident,dlo-allgather-codedp --steps 5 --warmup 2 --out "$OUT/kp" \
  > "$OUT/dlo-kp.log" 2>&1
echo "dlo kp rc=$? at $((SECONDS-T0)) s"; grep -E "ms/step" "$OUT/dlo-kp.log" | grep "rank 0\]" | tail -3
