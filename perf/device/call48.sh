# h200 (twelfth session): exp-kp launch sweep -- tiles 4096 / 8192 / 16384 x 4 / 8 / 16 warps, Student-t double and
# single blocks (bench_codec), to see how far the lean kernel is from the probe's 1.9-2.2 TB/s. ~120 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout 200 python3 perf/bench_codec.py --sizes double single --fills student-t --codec exp-kp --tiles 4096 8192 16384 \
  --num-warps 8 4 16 --planes gather --no-build --out "$OUT" > "$OUT/codec.log" 2>&1
echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "\] decode" "$OUT/codec.log"
