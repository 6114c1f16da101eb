# h200 (fourteenth session): the element path's chunk. The one-launch decode at chunks 256..2048 against
# today's 1024, every codec, 4 and 8 warps (perf/probe_words_only.py --elem-chunk). ~100 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 300 python3 perf/probe_words_only.py --codec exp-k exp-k2 exp-kp --num-warps 4 8 \
  --elem-chunk 256 512 1024 2048 --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe rc=$? at $((SECONDS-T0)) s"; tail -c 6000 "$OUT/probe.log"
