# Pre-refactor regression run (RUNBOOK items 2-4): the in-place pipeline test, flux/wan perf with the
# compile modes, perf check. Results under $OUT.
source perf/device/prefix.sh || exit $?
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
  "tests/test_inplace_gpu.py::test_pipeline_graphs_keeps_module_and_saves" 2>&1 | tail -3
timeout ${WAN_TIMEOUT:-260} python3 -m perf run --scenario wan-14b-480p \
  --modes ${WAN_MODES:-resident,resident-compile,layerwise,layerwise-compile} --out "$OUT" --touch-gb 0 2>&1 | tail -12
timeout ${FLUX_TIMEOUT:-200} python3 -m perf run --scenario flux-12b-1024 --modes ${FLUX_MODES:-resident,layerwise,graphs} \
  --out "$OUT" --touch-gb 0 2>&1 | tail -10
python3 -m perf check "$OUT"/*.json 2>&1 | tail -20
