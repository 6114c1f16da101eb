# One device call: the GPU suite (xdist over one GPU), the multigpu suite (2 GPUs), then
# the codec kernel bench. Logs and JUnit files under $OUT. Usage: bash perf/device/test_suites.sh
source perf/device/prefix.sh || exit $?
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
N=${GPU_WORKERS:-4}
timeout ${GPU_TIMEOUT:-300} python3 -m pytest -q -m gpu -n "$N" -p no:cacheprovider --junitxml="$OUT/gpu.xml" \
  ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu.log" | tail -25
echo "gpu suite rc=$?"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && [ -z "$SKIP_MULTI" ]; then
  timeout ${MULTI_TIMEOUT:-200} python3 -m pytest -q -m multigpu -p no:cacheprovider --junitxml="$OUT/multigpu.xml" \
    tests 2>&1 | tee "$OUT/multigpu.log" | tail -15
  echo "multigpu suite rc=$?"
fi
if [ -n "$CODEC_BENCH" ]; then
  timeout ${CODEC_TIMEOUT:-150} python3 perf/bench_codec.py --sizes tensor single double --tiles 4096 --num-warps 4 8 \
    --planes gather reshape --check --out "$OUT" 2>&1 | tail -25
fi
