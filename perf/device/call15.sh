# x2 (seventh session): compute_priority='high' where decode and gathers share the SMs with compute: wan coded
# (target <= 1.01 x resident-tfill; plain coded was 1.011 x at c99ccf1) and 2x DLO AllGather coded (1.384 x at
# f256e98), plus the multigpu DLO-coded tests (a test-key fix never re-run) and the priority GPU test.
# WEIGHTSTREAM_COMMIT must be given. About 450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${GPU_TIMEOUT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_compute_priority.py > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|passed|failed" "$OUT/gpu.log" | tail -4
timeout ${DLO_TIMEOUT:-150} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded-hiprio --steps 5 --warmup 2 \
  --out "$OUT" > "$OUT/dlo.log" 2>&1; echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "^\||ms|x " | tail -6
timeout ${MULTI_TIMEOUT:-100} python3 -m pytest -q -m multigpu -p no:cacheprovider tests/test_dlo_coded_gpu.py \
  > "$OUT/multigpu.log" 2>&1; echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|passed|failed" "$OUT/multigpu.log" | tail -4
timeout ${WAN_TIMEOUT:-200} python3 -m perf run --scenario wan-14b-480p --touch-gb 0 --mode-timeout 95 --out "$OUT" \
  --modes ${WAN_MODES:-resident-tfill,layerwise-coded-hiprio} > "$OUT/wan.log" 2>&1
echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -3
