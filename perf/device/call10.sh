# x2: DLO AllGather with coded shards (bench), then the multigpu coded/event-log tests (both GPUs,
# background) beside the whole GPU suite (xdist). WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${DLO_TIMEOUT:-200} python3 perf/bench_dlo.py --modes resident,dlo-allgather,dlo-allgather-coded --steps 5 --warmup 2 \
  --out "$OUT" > "$OUT/dlo.log" 2>&1; echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "^\||ms|x " | tail -8
(timeout ${MULTI_TIMEOUT:-250} python3 -m pytest -v -m multigpu -p no:cacheprovider tests/test_dlo_coded_gpu.py \
  "tests/test_distributed_gpu.py::test_nccl_event_log_and_pinned_shards" > "$OUT/multigpu.log" 2>&1; \
  echo "multigpu rc=$?" >> "$OUT/multigpu.log") &
timeout ${GPU_TIMEOUT:-300} python3 -m pytest -v -m gpu -n ${GPU_WORKERS:-8} -p no:cacheprovider tests \
  > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
wait
grep -E "FAILED|ERROR" "$OUT/gpu.log" | grep -v "^E " | head -20; grep -E "passed|failed" "$OUT/gpu.log" | tail -2
grep -E "FAILED|ERROR|PASSED" "$OUT/multigpu.log" | tail -12; tail -3 "$OUT/multigpu.log"
