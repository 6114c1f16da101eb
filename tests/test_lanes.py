"""perf/lanes.py: copy-lane gaps of a profiler trace (pure, synthetic events)."""
from perf.lanes import lane_summary  # the checkout's root is on sys.path (conftest.py)


def _copy(ts, dur, nbytes):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"bytes": nbytes}}


def _kernel(ts, dur, name="gemm"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_gaps_and_busy_times():
    ev = [
        _copy(0, 1000, 680e6), _copy(1000, 1000, 680e6),  # back to back
        _copy(5000, 500, 283e6),  # 3 ms gap before it
        _copy(5600, 400, 283e6),  # 0.1 ms gap: under the threshold
        _kernel(1500, 2000), _kernel(3000, 1000, "attn"), _kernel(9000, 10),  # the last one is outside the copy window
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 2000, "dur": 3000},  # not a H2D copy
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2000, "dur": 3000},
    ]
    s = lane_summary(ev)
    assert s["copies"] == 4 and s["kernels"] == 3
    assert s["window_ms"] == 6.0 and s["copy_busy_ms"] == 2.9 and s["copy_idle_ms"] == 3.1
    assert s["compute_busy_ms"] == 2.5  # kernels 1.5..4.0 ms within the window
    assert s["gaps_over_min"] == 1 and s["gaps_in_time_order"] == [(2.0, 3.0)]
    g = s["gaps"][0]
    assert g["compute_busy_ms"] == 2.0 and g["kernels"] == 2 and g["first_kernels"] == ["gemm", "attn"]
    assert g["copy_before_mb"] == 680.0 and g["copy_after_mb"] == 283.0
    assert s["big_copy_gbps_median"] == 680.0  # bytes/us/1e3 = GB/s


def test_no_copies():
    assert lane_summary([_kernel(0, 5)]) == {"copies": 0, "kernels": 1}


def test_kernel_totals_per_class_and_stream():
    from perf.lanes import kernel_class, kernel_totals

    def k(ts, dur, name, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    ev = [
        k(0, 3000, "sm90_xmma_gemm_bf16", 7), k(2000, 2000, "flash_fwd_kernel", 7),  # overlapping on stream 7
        k(1000, 500, "ncclDevKernel_AllGather_RING_LL", 21), k(1600, 400, "_decode_kernel", 21),
        k(9000, 1000, "_decode_kernel", 21),
        _copy(0, 100, 1e6),  # not a kernel
    ]
    t = kernel_totals(ev)
    assert t["kernels"] == 5 and t["span_ms"] == 10.0
    assert t["classes"] == {"other": {"count": 2, "ms": 5.0}, "nccl": {"count": 1, "ms": 0.5},
                            "decode": {"count": 2, "ms": 1.4}}
    assert t["streams"]["7"] == {"busy_ms": 4.0, "ms": {"other": 5.0}}  # union 0..4 ms, summed 5 ms
    assert t["streams"]["21"]["busy_ms"] == 1.9 and t["streams"]["21"]["ms"] == {"nccl": 0.5, "decode": 1.4}
    assert kernel_class("NCCLDEVKERNEL_x") == "nccl" and kernel_class("gemm") == "other"
    assert kernel_totals([_copy(0, 1, 1)]) == {"kernels": 0}
