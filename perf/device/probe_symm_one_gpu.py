"""Probe (device): can two processes on ONE GPU use torch symmetric memory over a gloo group?

If yes, a copy-engine DLO gather can be tested for correctness on one H200 (not for speed).
Checks: rendezvous, peer buffer read by copy_ (a D2D memcpy), barrier, put/wait_signal, and the
same under a CUDA graph capture + replay. Prints one line per check and rank.
"""
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed._symmetric_memory as symm
    g = dist.group.WORLD
    say = lambda *a: print(f"[rank {rank}]", *a, flush=True)
    try:
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(g.group_name)
        n = 1 << 20
        t = symm.empty(n, dtype=torch.uint8, device="cuda:0")
        hdl = symm.rendezvous(t, g)
        say("rendezvous ok", type(hdl).__name__, "world", hdl.world_size, "rank", hdl.rank)
        t.fill_(rank + 1)
        out = torch.zeros(world * n, dtype=torch.uint8, device="cuda:0")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            hdl.barrier(channel=0)
            for p in range(world):
                out[p * n:(p + 1) * n].copy_(hdl.get_buffer(p, (n,), torch.uint8))
            hdl.barrier(channel=1)
        torch.cuda.synchronize()
        ok = all(bool((out[p * n:(p + 1) * n] == p + 1).all()) for p in range(world))
        say("eager pull gather", "ok" if ok else "WRONG")
        # signals
        with torch.cuda.stream(s):
            peer = (rank + 1) % world
            hdl.put_signal(peer, channel=2)
            hdl.wait_signal((rank - 1) % world, channel=2)
        torch.cuda.synchronize()
        say("put/wait signal ok")
        # graph
        graph = torch.cuda.CUDAGraph()
        out.zero_()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=s):
            hdl.barrier(channel=0)
            for p in range(world):
                out[p * n:(p + 1) * n].copy_(hdl.get_buffer(p, (n,), torch.uint8))
            hdl.barrier(channel=1)
        for it in range(3):
            t.fill_(10 * it + rank)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            ok = all(bool((out[p * n:(p + 1) * n] == 10 * it + p).all()) for p in range(world))
            say("graph replay", it, "ok" if ok else "WRONG")
        # big copy rate (same GPU: only says the memcpy path works, not NVLink speed)
        big = 256 << 20
        tb = symm.empty(big, dtype=torch.uint8, device="cuda:0")
        hb = symm.rendezvous(tb, g)
        dst = torch.empty(big, dtype=torch.uint8, device="cuda:0")
        src = hb.get_buffer((rank + 1) % world, (big,), torch.uint8)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        say(f"peer-buffer copy {10 * big / dt / 1e9:.1f} GB/s (same GPU)")
        # timeout behaviour of barrier (peer absent): only rank 0 waits with a timeout
    except Exception:
        say("FAILED\n" + traceback.format_exc())
        sys.exit(3)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print("torch", torch.__version__, "gpus", torch.cuda.device_count(), flush=True)
    mp.spawn(run, args=(2, 29533), nprocs=2, join=True)
    print("probe done", flush=True)
