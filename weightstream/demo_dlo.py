"""``python -m weightstream demo --dlo allgather|rank-local``: distributed layerwise offload.

Launched as ``torchrun --nproc-per-node 2 -m weightstream demo --dlo allgather``.
The demo plays the user who owns the topology: it initialises the process
group from torchrun's environment (NCCL on CUDA, gloo on CPU), builds the same
random-weight tiny Flux on every rank (same seed), gives each rank its own
request (DP), checks the request wave, then runs the model resident and with
DLO and prints, per rank, whether the outputs match bit for bit, the host bytes
this rank keeps, and the step times. Started without torchrun it launches two
local CPU ranks itself.
"""
from __future__ import annotations

import os

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import copy  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

TRANSFERS = ("allgather", "rank-local")
LOCAL_RANKS = 2


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _say(rank: int, world: int, msg: str) -> None:
    print(f"[rank {rank}/{world}] {msg}", flush=True)


def _timed_steps(fn, steps: int, cuda: bool) -> tuple[float, list[torch.Tensor]]:
    outs = []
    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            outs.append(_first(fn()))
        if cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3, outs


def _rank_main(transfer: str, steps: int) -> int:
    import torch.distributed as dist

    from weightstream import OffloadConfig, OffloadedTransformer
    from weightstream.models import flux_inputs, tiny_flux
    from weightstream.offload.dlo.topology import ParallelConfig
    from weightstream.offload.dlo.control import validate_wave

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = (os.environ.get("WEIGHTSTREAM_DEMO_DEVICE") != "cpu" and torch.cuda.is_available()
            and local < torch.cuda.device_count())
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")  # the user's topology; DLO only consumes it
    try:
        parallel = ParallelConfig.data_parallel()
        dtype = torch.bfloat16 if cuda else torch.float32
        model = tiny_flux(seed=0, dtype=dtype)  # the same weights on every rank
        inputs = flux_inputs(model, device=device, seed=1 + rank)  # this rank's own request
        request = {"prompt": f"request {rank}", "num_inference_steps": steps, "height": 64, "width": 64}
        validate_wave(request, parallel, transfer=transfer)
        resident = copy.deepcopy(model).to(device)
        resident_ms, refs = _timed_steps(lambda: resident(**inputs), steps, cuda)
        del resident
        cfg = OffloadConfig.layerwise(weight_transfer=transfer, progress=False)
        t0 = time.perf_counter()
        streamed = OffloadedTransformer(model, cfg, device=device, parallel=parallel)
        setup_s = time.perf_counter() - t0
        dlo_ms, outs = _timed_steps(lambda: streamed(**inputs), steps, cuda)
        s = streamed.stats()
        match = all(torch.equal(o, refs[0]) for o in outs)
        plain = streamed.disable()  # a collective with allgather: every rank gathers each block once
        with torch.no_grad():
            restored = torch.equal(_first(plain(**inputs)), refs[0])
        how = (f"allgather over the {s['shard_group']} group of {s['shard_group_size']}"
               if s["transfer"] == "allgather" else f"rank-local, no weight collective ({s['parallel']})")
        _say(rank, world, f"device {device}, {how}; outputs match resident bit for bit: {match} "
                          f"({steps} steps); after disable(): {restored}")
        _say(rank, world, f"host bytes on this rank {s['host_bytes'] / 1e6:.3f} MB of model "
                          f"{s['model_bytes'] / 1e6:.3f} MB ({s['host_bytes'] / s['model_bytes']:.2f}x), "
                          f"pinned {s['pinned_host_gb_per_rank'] * 1e3:.3f} MB, H2D {s['h2d_bytes_per_step'] / 1e6:.3f} "
                          f"MB/step")
        _say(rank, world, f"time: resident {resident_ms:.2f} ms/step, DLO {dlo_ms:.2f} ms/step, setup {setup_s:.3f} s")
        ok = [None] * world
        dist.all_gather_object(ok, bool(match and restored))
        if rank == 0:
            print(f"all {world} ranks match bit for bit: {all(ok)}", flush=True)
        return 0 if all(ok) else 1
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank(rank: int, world: int, port: int, transfer: str, steps: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WEIGHTSTREAM_DEMO_DEVICE="cpu")
    code = _rank_main(transfer, steps)  # its results are checked and printed; the group is destroyed
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown in this spawned child: on a loaded CPU machine gloo's C++ threads
    # sometimes abort it after the work is done ("terminate called without an active exception")
    os._exit(code)


def run_dlo_demo(transfer: str, steps: int = 3) -> int:
    """Run the DLO demo on this rank (under torchrun) or on 2 local CPU ranks. Returns an exit code."""
    if transfer not in TRANSFERS:
        print(f"--dlo {transfer!r} is not allowed; choose from: {', '.join(TRANSFERS)}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(transfer, steps)
    import multiprocessing as mp

    print(f"not launched by torchrun: starting {LOCAL_RANKS} local CPU ranks (gloo). On GPUs run: "
          f"torchrun --nproc-per-node 2 -m weightstream demo --dlo {transfer}", flush=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_local_rank, args=(r, LOCAL_RANKS, port, transfer, steps))
             for r in range(LOCAL_RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    bad = [c for c in codes if c != 0]
    return bad[0] if all(c is not None and c > 0 for c in bad) else 1  # a signal or no exit code: failure
