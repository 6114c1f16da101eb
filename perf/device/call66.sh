# h200 (sixteenth session): the element path's chunk again, now that it is a runtime loop (calls 56-57 swept it
# unrolled: 512 at 4 warps won). exp-k / exp-kp / exp-k2 at 4 and 8 warps, chunks 128..2048
# (perf/probe_words_only.py --elem-chunk; each checked byte-equal to the default decode). ~300 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${PROBE_TIMEOUT:-420} python3 perf/probe_words_only.py --codec exp-k exp-kp exp-k2 --num-warps 4 8 \
  --elem-chunk 128 256 512 1024 2048 --out "$OUT" > "$OUT/probe.log" 2>&1
echo "probe rc=$? at $((SECONDS-T0)) s"
python3 - "$OUT/probe.log" <<'PY'
import ast, sys
for line in open(sys.argv[1]):
    if line.startswith("{'size'"):
        r = ast.literal_eval(line)
        print(r["codec"], r["num_warps"], "default", r["full_gbps"], {c: (v["gbps"], v["exact"]) for c, v in r["elem_chunks"].items()})
PY
tail -5 "$OUT/probe.log"
