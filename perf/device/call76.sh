# h200 (eighteenth session): bench_dlo with one rank (NCCL world of one: the gather a copy, the link the whole block)
# -- the AllGather auto codec at Flux-12B scale on real NCCL and CUDA (57 blocks sampled, planned, coded at once),
# against exp-k on every block. A scale check of the mechanism, not the x2 target. WEIGHTSTREAM_COMMIT must be given.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${DLO_TIMEOUT:-420} python3 perf/bench_dlo.py --nproc 1 --modes resident,dlo-allgather-coded,dlo-allgather-codedauto \
  --steps 5 --warmup 2 --out "$OUT" > "$OUT/dlo1.log" 2>&1
echo "dlo1 rc=$? at $((SECONDS-T0)) s"; grep -E "ms/step|wrote|auto codec|Error|error" "$OUT/dlo1.log" | cut -c1-400 | tail -12
