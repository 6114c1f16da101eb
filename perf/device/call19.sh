# x2 (eighth session): 2x DLO AllGather coded with the word-path decode (1.356-1.384 x resident before; target
# <= 1.10), the multigpu DLO-coded tests, and the H2D copy rate eager vs from a CUDA graph, alone and beside a GEMM
# loop (why graphs-coded copies ran ~49 GB/s against ~53 eager). WEIGHTSTREAM_COMMIT must be given. About 330 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${COPY_TIMEOUT:-60} python3 perf/bench_graph_copy.py --out "$OUT" > "$OUT/graphcopy.log" 2>&1
echo "graphcopy rc=$? at $((SECONDS-T0)) s"; grep -E "GB/s" "$OUT/graphcopy.log"
timeout ${DLO_TIMEOUT:-170} python3 perf/bench_dlo.py --modes resident,dlo-allgather-coded --steps 5 --warmup 2 \
  --out "$OUT" > "$OUT/dlo.log" 2>&1; echo "dlo rc=$? at $((SECONDS-T0)) s"; grep -v "^\[rank" "$OUT/dlo.log" | grep -E "^\||ms|x " | tail -6
timeout ${MULTI_TIMEOUT:-100} python3 -m pytest -q -m multigpu -p no:cacheprovider tests/test_dlo_coded_gpu.py \
  > "$OUT/multigpu.log" 2>&1; echo "multigpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|passed|failed" "$OUT/multigpu.log" | tail -4
