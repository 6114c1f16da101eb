# h200 (ninth session): decode_at="use" (the decode issued just before the block computes, after the next
# block's copy was captured): GPU tests of the coded source and graphs with it on, then flux graphs-coded
# with the decode issued at load (today) / at use on the decode stream / at use on the compute stream, and
# layerwise-coded at use. Experiment switches: WEIGHTSTREAM_EXPERIMENT_DECODE_AT / _DECODE_STREAM.
# WEIGHTSTREAM_COMMIT must be given. ~330 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
WEIGHTSTREAM_EXPERIMENT_DECODE_AT=use timeout ${GPU_TIMEOUT:-100} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
  tests/test_coded_source_gpu.py tests/test_mmap_coded_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu(use) rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu.log" | tail -6
flux() {  # tag, modes, env...
  local tag=$1 modes=$2; shift 2
  env "$@" timeout ${FLUX_TIMEOUT:-100} python3 -m perf run --scenario flux-12b-1024 --touch-gb 0 --mode-timeout 55 \
    --out "$OUT/$tag" --modes $modes > "$OUT/flux-$tag.log" 2>&1; echo "flux $tag rc=$? at $((SECONDS-T0)) s"
  grep -E "^\| " "$OUT/flux-$tag.log" | tail -2
}
flux use-side graphs-coded,layerwise-coded WEIGHTSTREAM_EXPERIMENT_DECODE_AT=use
flux use-compute graphs-coded WEIGHTSTREAM_EXPERIMENT_DECODE_AT=use WEIGHTSTREAM_EXPERIMENT_DECODE_STREAM=0
flux load graphs-coded WEIGHTSTREAM_EXPERIMENT_DECODE_AT=load
