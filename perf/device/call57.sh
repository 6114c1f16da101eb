# h200 (fourteenth session): call56 timed out after exp-k (chunk 512 at 4 warps: 1274.6 GB/s against 1115.5 at
# today's 1024). The same for exp-k2 and exp-kp at 4 warps (the default). ~250 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 320 python3 perf/probe_words_only.py --codec exp-kp exp-k2 --num-warps 4 \
  --elem-chunk 256 512 1024 --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe rc=$? at $((SECONDS-T0)) s"; tail -c 6000 "$OUT/probe.log"
