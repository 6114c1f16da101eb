# h200 (sixteenth session): the compute a decode steals beside a GEMM loop, on the runtime chunk loop at 4 warps
# (perf/bench_decode_steal.py; last run at 8 warps on the word-path kernel). For the DLO AllGather coded estimate:
# each rank decodes the whole block (23.7 GB a Flux step). WEIGHTSTREAM_COMMIT must be given. ~90 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${STEAL_TIMEOUT:-150} python3 perf/bench_decode_steal.py --num-warps 4 --codec exp-k exp-k2 exp-kp --reps 9 \
  --out "$OUT" > "$OUT/steal.log" 2>&1
echo "steal rc=$? at $((SECONDS-T0)) s"; tail -c 3000 "$OUT/steal.log"
