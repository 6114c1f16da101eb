# x2: the DLO bench alone first, then the multigpu suite (both GPUs, background) beside the GPU suite
# (xdist on GPU 0). Logs with test names under $OUT. WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
timeout ${DLO_TIMEOUT:-170} python3 perf/bench_dlo.py --modes resident,dlo-allgather --steps 5 --warmup 2 \
  --out "$OUT" 2>&1 | grep -v "^\[rank" | tail -6
(timeout ${MULTI_TIMEOUT:-380} python3 -m pytest -v -m multigpu -p no:cacheprovider tests > "$OUT/multigpu.log" 2>&1; \
  echo "multigpu rc=$?" >> "$OUT/multigpu.log") &
timeout ${GPU_TIMEOUT:-370} python3 -m pytest -v -m gpu -n ${GPU_WORKERS:-6} -p no:cacheprovider tests \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$?"
wait
grep -E "FAILED|ERROR" "$OUT/gpu.log" | grep -v "^E " | head -20; grep -E "passed|failed" "$OUT/gpu.log" | tail -2
grep -E "FAILED|ERROR|PASSED" "$OUT/multigpu.log" | tail -30; tail -3 "$OUT/multigpu.log"
