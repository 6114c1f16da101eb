# DLO bench (the end-of-step agreement's cost), the mmap GPU tests, then the multigpu suite.
source perf/device/prefix.sh || exit $?
timeout ${DLO_TIMEOUT:-160} python3 perf/bench_dlo.py --modes resident,dlo-allgather --steps 5 --warmup 2 \
  --out "$OUT" 2>&1 | grep -v "^\[rank" | tail -8
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mmap_source_gpu.py 2>&1 | tail -3
timeout ${MULTI_TIMEOUT:-330} python3 -m pytest -v -m multigpu -p no:cacheprovider tests/test_distributed_gpu.py \
  2>&1 | tee "$OUT/multigpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tail -25
