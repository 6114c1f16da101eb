# h200 (seventh session): decode-kernel launch options sweep, the GPU tests call12 cut, one profiled graphs-coded
# run (why 0.80 x against eager 0.75 x). WEIGHTSTREAM_COMMIT must be given. About 450 s.
source perf/device/prefix.sh || exit $?
T0=$SECONDS
timeout ${CODEC_TIMEOUT:-150} python3 perf/bench_codec.py --sizes double --fills student-t --tiles 4096 8192 16384 \
  --num-warps 8 16 4 --planes gather --search binary vector --table load regs --no-build --no-graph --out "$OUT" \
  > "$OUT/codec.log" 2>&1; echo "codec rc=$? at $((SECONDS-T0)) s"; grep -E "decode .* ms" "$OUT/codec.log" \
  | sed -E 's/ \(.*GB\/s DRAM\)//; s/; copy.*//' | sort -t= -k2 -rn | head -40
timeout ${GPU_TIMEOUT:-260} python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --durations=8 tests/kernels/test_codec.py \
  tests/test_coded_source_gpu.py tests/test_bounce_gpu.py tests/test_mmap_coded_gpu.py tests/test_module_coded.py \
  tests/test_pack_rss.py tests/test_graphs_gpu.py > "$OUT/gpu.log" 2>&1; echo "gpu rc=$? at $((SECONDS-T0)) s"
grep -E "^FAILED|^ERROR|passed|failed|[0-9.]+s (call|setup)" "$OUT/gpu.log" | tail -16
timeout ${PROF_TIMEOUT:-100} python3 -m perf _worker --scenario flux-12b-1024 --mode graphs-coded --steps 3 --warmup 2 \
  --profile-dir "$OUT/prof" --profile-steps 2 > "$OUT/prof.log" 2>&1; echo "prof rc=$? at $((SECONDS-T0)) s"
grep -vE "^\{|it/s|B/s\]" "$OUT/prof.log" | tail -6 | cut -c1-300; ls -la "$OUT/prof" 2>/dev/null | head
