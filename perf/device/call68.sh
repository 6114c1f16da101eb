# x2 (sixteenth session): call54 (multigpu DLO coded + distributed tests; bench_dlo resident + dlo-allgather-coded /
# -codedp / -coded2 with rank 0's profile), then, since 8a317fb moved the gathers a block earlier (off the critical
# path, where NCCL at 4 / 8 channels had lost in call20), the exp-k mode at 8 channels, then 3 slots.
# WEIGHTSTREAM_COMMIT must be given. ~330-450 s; the later parts are skipped when their time is not left.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
left() { [ $((SECONDS - T0)) -lt "$1" ]; }
timeout ${MULTI_TIMEOUT:-150} python3 -m pytest -q -m multigpu -p no:cacheprovider -rfE tests/test_dlo_coded_gpu.py \
  tests/test_distributed_gpu.py > "$OUT/multigpu.log" 2>&1
echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/multigpu.log" | tail -6
timeout ${DLO_TIMEOUT:-200} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded,dlo-allgather-codedp,dlo-allgather-coded2 \
  --steps 5 --warmup 2 --profile-dir "$OUT/prof2" --out "$OUT" > "$OUT/dlo.log" 2>&1
echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "ms/step|wrote" | tail -5
grep -E "ms/step" "$OUT/dlo.log" | grep "rank 0\]" | tail -6
left 420 || exit 0
mkdir -p "$OUT/ch8"
NCCL_MIN_NCHANNELS=8 NCCL_MAX_NCHANNELS=8 timeout 80 python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded \
  --steps 5 --warmup 2 --out "$OUT/ch8" > "$OUT/dlo-ch8.log" 2>&1
echo "dlo ch8 rc=$? at $((SECONDS-T0)) s"; grep -E "ms/step" "$OUT/dlo-ch8.log" | grep "rank 0\]" | tail -3
left 470 || exit 0
mkdir -p "$OUT/slots3"
timeout 80 python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded --num-slots 3 \
  --steps 5 --warmup 2 --out "$OUT/slots3" > "$OUT/dlo3.log" 2>&1
echo "dlo slots3 rc=$? at $((SECONDS-T0)) s"; grep -E "ms/step" "$OUT/dlo3.log" | grep "rank 0\]" | tail -3
