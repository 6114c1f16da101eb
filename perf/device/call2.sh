# multigpu suite, the GPU tests that failed in call 1, the mmap pinned diagnosis, DLO bench.
source perf/device/prefix.sh || exit $?
timeout 60 python3 perf/device/diag_mmap_pinned.py 2>&1 | tail -5
timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_trust_exec_gpu.py tests/test_trust_save_gpu.py \
  2>&1 | tee "$OUT/gpu-rerun.log" | tail -4
timeout ${MULTI_TIMEOUT:-300} python3 -m pytest -v -m multigpu -p no:cacheprovider tests/test_distributed_gpu.py \
  2>&1 | tee "$OUT/multigpu.log" | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -25
echo "multigpu rc=$?"
if [ -n "$DLO_BENCH" ]; then
  timeout ${DLO_TIMEOUT:-170} python3 perf/bench_dlo.py --modes resident,dlo-allgather --steps 5 --warmup 2 \
    --out "$OUT" 2>&1 | tail -12
fi
