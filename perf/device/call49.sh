# h200 (twelfth session): perf/probe_words_only.py -- the decode kernel with only its word path compiled against
# the one-launch kernel (exp-k, exp-kp; 8 / 4 warps; Student-t double block): does the element path's register
# use hold the word path back? ~90 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 200 python3 perf/probe_words_only.py --out "$OUT" 2>&1 | tee "$OUT/probe.log" | tail -6
echo "probe rc=$? at $((SECONDS-T0)) s"
