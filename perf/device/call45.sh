# h200 (twelfth session): probe a decode that patches escapes after each tile (perf/probe_patch_decode.py) against
# today's word path: standalone GB/s and steal beside a GEMM loop, k = 3 and 4, 8 / 4 warps. Then the auto codec
# GPU tests (5ced0ce's retire change never ran on a GPU). WEIGHTSTREAM_COMMIT must be given. ~200 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 240 python3 perf/probe_patch_decode.py --k 3 4 --num-warps 8 4 --patch 256 --out "$OUT" 2>&1 | tee "$OUT/probe.log" | grep -v "^{"
echo "probe rc=$? at $((SECONDS-T0)) s"
GPU_TESTS="tests/test_auto_codec.py" SKIP_MULTI=1 GPU_WORKERS=2 GPU_TIMEOUT=200 bash perf/device/test_suites.sh
echo "done at $((SECONDS-T0)) s"
