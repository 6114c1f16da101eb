"""Host copy rate from a file mapping into a registered buffer: what the staging packer can reach.

    python perf/bench_hostcopy.py [--gb 4] [--file /tmp/ws-hostcopy.bin] [--threads 1,2,4,8,16]

The staging fallback packs checkpoint pages (a read-only file mapping, page
cache) into pinned buffers while the copy engine reads the other buffer. Its
step time is bound by the slower of the two, so this measures, on one machine:

- ``torch-main`` / ``torch-thread``: ``Tensor.copy_`` of block-sized pieces
  from the mapping, called on the main thread / on a side thread (what the
  single packer thread did);
- ``pool-<N>``: :class:`weightstream.offload.staging.CopyPool` with N threads;
- ``pool-<N>-with-dma`` (CUDA): the same while the copy engine streams pinned
  memory to the device, and the H2D rate it keeps meanwhile (``dma_gbps``);
- ``dma-alone``: that H2D rate with the host idle.

GB/s counts bytes copied (memory traffic is twice that). Results:
``perf/results/hostcopy-<gpu>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import os
import re
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from perf.common import short_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
PIECE = 680 * 2**20  # a Flux double block


def log(msg: str) -> None:
    print(f"[bench_hostcopy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_file(path: Path, nbytes: int) -> None:
    if path.exists() and path.stat().st_size == nbytes:
        return
    chunk = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(256 << 20):
            pass


def _pieces(total: int) -> list[tuple[int, int]]:
    return [(at, min(PIECE, total - at)) for at in range(0, total, PIECE)]


def pass_torch(src: torch.Tensor, dst: torch.Tensor) -> int:
    for j, (at, n) in enumerate(_pieces(src.numel())):
        half = (j % 2) * PIECE
        dst[half : half + n].copy_(src[at : at + n])
    return src.numel()


def pass_pool(pool, src: torch.Tensor, dst: torch.Tensor) -> int:
    s, d = src.data_ptr(), dst.data_ptr()
    for j, (at, n) in enumerate(_pieces(src.numel())):
        pool.copy([(d + (j % 2) * PIECE, s + at, n)])
    return src.numel()


def rate(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        out.append(n / GB / (time.perf_counter() - t))
    return statistics.median(out)


def on_thread(fn):
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("v", fn()), name="bench-side")
    th.start()
    th.join()
    return box["v"]


def with_dma(fn, device, host: torch.Tensor, copies: int) -> tuple[float, float]:
    """Run ``fn`` (returns bytes) in a loop while ``copies`` H2D copies of ``host`` run."""
    dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        s.record(stream)
        for _ in range(copies):
            dev.copy_(host, non_blocking=True)
        e.record(stream)
    t, nbytes = time.perf_counter(), 0
    while not e.query():
        nbytes += fn()
    host_gbps = nbytes / GB / (time.perf_counter() - t)
    e.synchronize()
    return host_gbps, copies * host.numel() / GB / (s.elapsed_time(e) / 1e3)


def dma_alone(device, host: torch.Tensor, copies: int) -> float:
    dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    s.record()
    for _ in range(copies):
        dev.copy_(host, non_blocking=True)
    e.record()
    e.synchronize()
    return copies * host.numel() / GB / (s.elapsed_time(e) / 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python perf/bench_hostcopy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="file size (default: %(default)s)")
    p.add_argument("--file", type=Path, default=Path("/tmp/ws-hostcopy.bin"))
    p.add_argument("--threads", default="1,2,4,8,16", help="pool sizes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dma-copies", type=int, default=40, help="1 GiB H2D copies queued per with-dma run")
    p.add_argument("--out", type=Path, default=ROOT / "perf" / "results")
    args = p.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",") if x]
    if not threads or min(threads) < 1:
        p.error(f"--threads={args.threads!r}: give pool sizes >= 1, e.g. 1,2,4,8")

    from weightstream.offload.staging import CopyPool, PinnedBuffer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    nbytes = int(args.gb * GB) // 4096 * 4096
    t = time.perf_counter()
    make_file(args.file, nbytes)
    warm(args.file)
    log(f"{nbytes / GB:.1f} GB file ready and read once in {time.perf_counter() - t:.1f} s ({args.file})")
    with open(args.file, "rb") as f:
        mp = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: torch warns, we never write
        src = torch.frombuffer(mp, dtype=torch.uint8)
    dst = PinnedBuffer(2 * PIECE, pin=cuda)
    modes: dict[str, dict] = {}

    def put(name, gbps, **extra):
        modes[name] = {"gbps": round(gbps, 2), **extra}
        log(f"{name:<22} {gbps:7.1f} GB/s" + "".join(f"  {k}={v}" for k, v in extra.items()))

    pass_torch(src, dst.tensor)  # touch every page of the mapping once
    put("torch-main", rate(lambda: pass_torch(src, dst.tensor), args.repeats), torch_threads=torch.get_num_threads())
    put("torch-thread", on_thread(lambda: rate(lambda: pass_torch(src, dst.tensor), args.repeats)))
    dma_host = None
    if cuda:
        dma_host = PinnedBuffer(1 << 30, pin=True)
        put("dma-alone", dma_alone(device, dma_host.tensor, args.dma_copies // 2), buffer=dma_host.kind)
    for n in threads:
        pool = CopyPool(n)
        try:
            put(f"pool-{n}", rate(lambda: pass_pool(pool, src, dst.tensor), args.repeats))
            if cuda:
                host, dma = with_dma(lambda: pass_pool(pool, src, dst.tensor), device, dma_host.tensor, args.dma_copies)
                put(f"pool-{n}-with-dma", host, dma_gbps=round(dma, 2))
        finally:
            pool.close()
    if cuda:
        host, dma = with_dma(lambda: pass_torch(src, dst.tensor), device, dma_host.tensor, args.dma_copies)
        put("torch-main-with-dma", host, dma_gbps=round(dma, 2))

    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    result = {
        "scenario": "hostcopy", "gpu": gpu, "commit": short_commit(), "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "file_gb": round(nbytes / GB, 3), "piece_bytes": PIECE, "destination": dst.kind,
        "gbps": "bytes copied per second (memory traffic is twice that)", "modes": modes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = args.out / f"hostcopy-{slug}-{result['commit']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path}")
    del src
    dst.release()
    if dma_host is not None:
        dma_host.release()
    mp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
