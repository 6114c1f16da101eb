# h200 (fifteenth session): call60 (the 22 GPU tests call59 did not reach) then wan-14b-480p coded on ELEM_CHUNK 512
# (call59 with SKIP_SUITE=1 WAN=1). WEIGHTSTREAM_COMMIT must be given. ~400 s.
GPU_TIMEOUT=${GPU_TIMEOUT:-200} bash perf/device/call60.sh
SKIP_SUITE=1 WAN=1 bash perf/device/call59.sh
