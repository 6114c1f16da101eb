# h200 (seventh session): exp-k2 (two-level code) on the GPU -- its GPU tests, decode rate beside exp-k with and
# without scalar_loads, flux layerwise-coded2 (host store <= 0.70 x target); then, only when scalar_loads decodes
# >= 5% faster, flip its default on this copy and measure wan coded (target <= 1.01 x resident-tfill) as
# commit "<sha>+scalar". WEIGHTSTREAM_COMMIT must be given. About 250 s (+170 s with wan).
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${CODEC_TIMEOUT:-60} python3 perf/bench_codec.py --sizes double --fills student-t --codec exp-k exp-k2 \
  --loads vector scalar --no-build --no-graph --out "$OUT" > "$OUT/codec.log" 2>&1; echo "codec rc=$? at $((SECONDS-T0)) s"
grep -E "bits/weight|decode .* ms" "$OUT/codec.log" | sed -E 's/; copy.*//; s/; encode.*//' | cut -c1-160
timeout ${GPU_TIMEOUT:-120} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_module_coded.py -k "v2 or k2 or gpu_decode or scalar" > "$OUT/gpu.log" 2>&1
echo "gpu rc=$? at $((SECONDS-T0)) s"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -8
timeout ${FLUX_TIMEOUT:-110} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 75 --out "$OUT" \
  --modes resident-tfill,layerwise-coded2 > "$OUT/flux.log" 2>&1; echo "flux rc=$? at $((SECONDS-T0)) s"
grep -E "^\| " "$OUT/flux.log" | tail -3
FAST=$(python3 - "$OUT" <<'PY'
import glob, json, sys
m = json.load(open(glob.glob(sys.argv[1] + "/codec-*.json")[0]))["modes"]
r = [m[f"triton-double-student-t{c}-scalar"]["gbps"] / m[f"triton-double-student-t{c}"]["gbps"] for c in ("", "-k2")]
print("yes" if min(r) >= 1.05 else "no", *(f"{x:.3f}" for x in r), file=sys.stderr)
print("yes" if min(r) >= 1.05 else "no")
PY
)
echo "scalar faster: $FAST"
if [ "$FAST" = yes ]; then
  sed -i 's/^DEFAULT_SCALAR_LOADS = False/DEFAULT_SCALAR_LOADS = True/' kernels/codec.py && grep -n "^DEFAULT_SCALAR_LOADS" kernels/codec.py
  WEIGHTSTREAM_COMMIT=${WEIGHTSTREAM_COMMIT}+scalar timeout ${WAN_TIMEOUT:-190} python3 -m perf run --scenario wan-14b-480p \
    --touch-gb 0 --mode-timeout 92 --out "$OUT" --modes resident-tfill,layerwise-coded > "$OUT/wan.log" 2>&1
  echo "wan rc=$? at $((SECONDS-T0)) s"; grep -E "^\| " "$OUT/wan.log" | tail -3
fi
