"""NVML memory telemetry: a background sampler, a live terminal line, and the
`python -m weightstream monitor -- <command>` entry (`monitor_main`).

`MemoryMonitor` samples every visible GPU through nvidia-ml-py (pynvml) on a
background thread: used / total memory and GPU utilisation at `hz` (>= 50 Hz
is fine: each call is a few microseconds), PCIe rx / tx throughput on a second
thread (nvmlDeviceGetPcieThroughput itself averages over ~20 ms per call, so
it runs at its own pace and never slows the memory samples). On the same
sampler thread it reads torch's caching-allocator figures
(memory_allocated / memory_reserved per device, once this process has
initialised CUDA) and the resident set size of a host process tree.
Controller event logs (`OffloadedTransformer.events()` format) are attached
with `attach_events`; the saved trace feeds `weightstream.report`.

Without an NVIDIA driver it warns once and still records timestamps, host
memory, allocator figures (if any) and events.

Units in the trace: bytes, seconds since the monitor started, PCIe in MB/s
(1e6 bytes/s). PCIe rx is what the GPU receives (host-to-device traffic),
tx what it sends.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

from weightstream.tracefile import TRACE_FORMAT, save_trace, to_perfetto, trace_summary

EVENTS_DIR_ENV = "WEIGHTSTREAM_EVENTS_DIR"
_EVENT_KEYS = ("step", "block", "lane", "start_ms", "end_ms")


def _import_nvml():
    """pynvml, initialised; raises ImportError or pynvml.NVMLError."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _visible_cuda_ids(count: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries (indices or UUIDs) in CUDA order."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return [str(i) for i in range(count)]
    out = []
    for entry in vis.split(","):
        entry = entry.strip()
        if not entry or (entry.lstrip("-").isdigit() and int(entry) < 0):
            break  # CUDA stops at the first invalid entry
        out.append(entry)
    return out


def _proc_rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> list[int]:
    """pid and its descendants (psutil if present, else /proc)."""
    try:
        import psutil

        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except ImportError:
        pass
    except Exception:
        return [pid]
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, ()))
    return out


def tree_rss_bytes(pid: int) -> int | None:
    """Resident set size of a process and all its descendants."""
    total, seen = 0, False
    for p in _descendants(pid):
        rss = _proc_rss_bytes(p)
        if rss is not None:
            total += rss
            seen = True
    return total if seen else None


class MemoryMonitor:
    """Background sampler of GPU memory, utilisation and PCIe traffic.

    ``hz``: memory/utilisation samples per second. ``devices``: CUDA device
    indices (as this process sees them through CUDA_VISIBLE_DEVICES) to
    sample; None = every visible GPU. ``host_pid``: the process whose RSS
    (with its children) is sampled, default this one, at ``host_hz`` (0: not
    sampled). ``pcie``: sample PCIe throughput (needs NVML). Use as a context
    manager or start()/stop().
    """

    def __init__(self, hz: float = 100, devices: Iterable[int] | None = None, *,
                 host_pid: int | None = None, host_hz: float = 10, pcie: bool = True,
                 torch_stats: bool = True):
        if not (isinstance(hz, (int, float)) and 0 < hz <= 1000):
            raise ValueError(f"hz={hz!r} must be a number in (0, 1000]")
        self.hz = float(hz)
        self.host_hz = float(min(host_hz, hz)) if host_hz else 0.0
        self.host_pid = host_pid if host_pid is not None else os.getpid()
        self._want_devices = None if devices is None else [int(d) for d in devices]
        self._want_pcie = pcie
        self._want_torch = torch_stats
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._events: dict[str, Any] = {}
        self._t0 = None
        self._created = None
        self._end = None
        self.nvml = None
        self.nvml_message: str | None = None
        self.driver: str | None = None
        self.devices: list[dict] = []
        self._handles: list[Any] = []
        self.pcie_message: str | None = None
        self._reset_series()

    # ---------------------------------------------------------------- set-up
    def _reset_series(self):
        self.t: list[float] = []
        self.gpu: list[dict] = []
        self.pcie: list[dict] = []
        self.host = {"pid": self.host_pid, "t": [], "rss_bytes": []}
        self.torch = {"t": [], "devices": [], "allocated_bytes": [], "reserved_bytes": []}

    def _open_nvml(self):
        try:
            nvml = _import_nvml()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.nvml_message = (f"NVML unavailable ({type(e).__name__}: {e}): no GPU memory, utilisation "
                                 "or PCIe samples; recording timestamps, host memory, torch allocator "
                                 "figures and events only")
            warnings.warn(self.nvml_message, RuntimeWarning, stacklevel=3)
            return
        self.nvml = nvml
        try:
            self.driver = nvml.nvmlSystemGetDriverVersion()
        except nvml.NVMLError:
            self.driver = None
        count = nvml.nvmlDeviceGetCount()
        visible = _visible_cuda_ids(count)
        wanted = range(len(visible)) if self._want_devices is None else self._want_devices
        for cuda_idx in wanted:
            if not 0 <= cuda_idx < len(visible):
                raise ValueError(f"devices: CUDA device {cuda_idx} is not visible; visible: 0..{len(visible) - 1}")
            entry = visible[cuda_idx]
            h = self._nvml_handle(entry, count)
            self._handles.append(h)
            self.devices.append({
                "index": cuda_idx, "nvml_id": entry, "name": nvml.nvmlDeviceGetName(h),
                "uuid": nvml.nvmlDeviceGetUUID(h),
                "total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            })
        self.gpu = [{"used_bytes": [], "util_pct": []} for _ in self.devices]
        self.pcie = [{"t": [], "rx_mbs": [], "tx_mbs": []} for _ in self.devices]

    def _nvml_handle(self, entry: str, count: int):
        nvml = self.nvml
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        for i in range(count):  # UUID or UUID prefix, as CUDA accepts
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if nvml.nvmlDeviceGetUUID(h).startswith(entry):
                return h
        raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no NVML device")

    # ---------------------------------------------------------------- control
    def start(self) -> "MemoryMonitor":
        if self._threads:
            raise RuntimeError("this MemoryMonitor is already running")
        self._reset_series()
        self._open_nvml()
        self._created = datetime.now(timezone.utc)
        self._t0 = time.perf_counter()
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, name="ws-memory-monitor", daemon=True)]
        if self.nvml is not None and self._want_pcie and self.devices:
            self._threads.append(threading.Thread(target=self._run_pcie, name="ws-pcie-monitor", daemon=True))
        for th in self._threads:
            th.start()
        return self

    def stop(self) -> "MemoryMonitor":
        self._stop.set()
        for th in self._threads:
            th.join()
        self._threads = []
        self._end = time.perf_counter()
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
        return self

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set_host_pid(self, pid: int) -> None:
        self.host_pid = pid
        with self._lock:
            self.host["pid"] = pid

    def attach_events(self, events: list | Callable[[], list], name: str = "controller") -> None:
        """Attach a controller event log: a list of {step, block, lane,
        start_ms, end_ms} dicts, or a callable returning one (called when the
        trace is taken, e.g. ``model.events``)."""
        if not (callable(events) or isinstance(events, (list, tuple))):
            raise TypeError(f"events must be a list of event dicts or a callable returning one, got {type(events).__name__}")
        self._events[name] = events

    # ---------------------------------------------------------------- sampling
    def _run(self):
        period = 1.0 / self.hz
        host_period = 1.0 / self.host_hz if self.host_hz else float("inf")
        next_t = time.perf_counter()
        next_host = next_t if self.host_hz else float("inf")
        while True:
            now = time.perf_counter()
            self._sample(now, host=now >= next_host)
            if now >= next_host:
                next_host = now + host_period
            if self._stop.is_set():
                break
            next_t += period
            delay = next_t - time.perf_counter()
            if delay < 0:
                next_t, delay = time.perf_counter(), 0.0
            self._stop.wait(delay)

    def _sample(self, now: float, host: bool):
        t = now - self._t0
        gpu_vals = []
        for h in self._handles:
            try:
                used = int(self.nvml.nvmlDeviceGetMemoryInfo(h).used)
                util = int(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                used, util = None, None
            gpu_vals.append((used, util))
        torch_vals = self._torch_sample() if self._want_torch else None
        rss = tree_rss_bytes(self.host_pid) if host else None
        with self._lock:
            self.t.append(t)
            for series, (used, util) in zip(self.gpu, gpu_vals):
                series["used_bytes"].append(used)
                series["util_pct"].append(util)
            if torch_vals is not None:
                devs, alloc, res = torch_vals
                if not self.torch["devices"]:
                    self.torch["devices"] = devs
                    self.torch["allocated_bytes"] = [[] for _ in devs]
                    self.torch["reserved_bytes"] = [[] for _ in devs]
                self.torch["t"].append(t)
                for i in range(len(self.torch["devices"])):
                    self.torch["allocated_bytes"][i].append(alloc[i])
                    self.torch["reserved_bytes"][i].append(res[i])
            if rss is not None:
                self.host["t"].append(t)
                self.host["rss_bytes"].append(rss)

    @staticmethod
    def _torch_sample():
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        try:
            if not torch.cuda.is_initialized():
                return None  # never initialise CUDA from the sampler thread
            n = torch.cuda.device_count()
            return (list(range(n)), [int(torch.cuda.memory_allocated(i)) for i in range(n)],
                    [int(torch.cuda.memory_reserved(i)) for i in range(n)])
        except Exception:
            return None

    def _run_pcie(self):
        nvml = self.nvml
        while not self._stop.is_set():
            for i, h in enumerate(self._handles):
                try:
                    rx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES)
                    tx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES)
                except Exception as e:
                    self.pcie_message = f"PCIe throughput unavailable ({type(e).__name__}: {e})"
                    return
                t = time.perf_counter() - self._t0
                with self._lock:  # NVML reports KB/s
                    self.pcie[i]["t"].append(t)
                    self.pcie[i]["rx_mbs"].append(rx * 1e3 / 1e6)
                    self.pcie[i]["tx_mbs"].append(tx * 1e3 / 1e6)
                if self._stop.is_set():
                    return
            self._stop.wait(0.005)

    # ---------------------------------------------------------------- reading
    def latest(self) -> dict:
        """The newest values, for a live view."""
        with self._lock:
            out = {"t": self.t[-1] if self.t else 0.0, "gpus": [], "host_rss_bytes": None, "torch": []}
            for d, g, p in zip(self.devices, self.gpu, self.pcie):
                out["gpus"].append({
                    "index": d["index"], "name": d["name"], "total_bytes": d["total_bytes"],
                    "used_bytes": g["used_bytes"][-1] if g["used_bytes"] else None,
                    "util_pct": g["util_pct"][-1] if g["util_pct"] else None,
                    "rx_mbs": p["rx_mbs"][-1] if p["rx_mbs"] else None,
                    "tx_mbs": p["tx_mbs"][-1] if p["tx_mbs"] else None,
                })
            if self.host["rss_bytes"]:
                out["host_rss_bytes"] = self.host["rss_bytes"][-1]
            for i, dev in enumerate(self.torch["devices"]):
                out["torch"].append({"device": dev, "allocated_bytes": self.torch["allocated_bytes"][i][-1]})
        return out

    def events(self) -> dict[str, list[dict]]:
        out = {}
        for name, src in self._events.items():
            evs = src() if callable(src) else src
            out[name] = [_clean_event(e, name) for e in evs]
        return out

    def to_trace(self, meta: dict | None = None) -> dict:
        """The recorded data as a JSON-serialisable dict (format TRACE_FORMAT)."""
        events = self.events()
        end = self._end if not self._threads else time.perf_counter()
        with self._lock:
            n = len(self.t)
            duration = (end - self._t0) if self._t0 is not None and end is not None else 0.0
            trace = {
                "format": TRACE_FORMAT,
                "created": (self._created or datetime.now(timezone.utc)).isoformat().replace("+00:00", "Z"),
                "hz": self.hz, "duration_s": duration, "n_samples": n,
                "effective_hz": (n / duration) if duration > 0 else None,
                "nvml": {"available": self.nvml is not None, "message": self.nvml_message,
                         "driver": self.driver, "pcie_message": self.pcie_message},
                "devices": [dict(d) for d in self.devices],
                "t": list(self.t),
                "gpu": [{k: list(v) for k, v in g.items()} for g in self.gpu],
                "pcie": [{k: list(v) for k, v in p.items()} for p in self.pcie],
                "torch": {"t": list(self.torch["t"]), "devices": list(self.torch["devices"]),
                          "allocated_bytes": [list(x) for x in self.torch["allocated_bytes"]],
                          "reserved_bytes": [list(x) for x in self.torch["reserved_bytes"]]},
                "host": {"pid": self.host["pid"], "t": list(self.host["t"]),
                         "rss_bytes": list(self.host["rss_bytes"])},
                "events": events,
                "meta": dict(meta or {}),
            }
        return trace

    def save(self, path: str, meta: dict | None = None) -> dict:
        trace = self.to_trace(meta)
        save_trace(trace, path)
        return trace

    def summary(self) -> dict:
        return trace_summary(self.to_trace())


def _clean_event(e: dict, source: str) -> dict:
    missing = [k for k in _EVENT_KEYS if k not in e]
    if missing:
        raise ValueError(f"event log {source!r}: event {e!r} lacks {missing}; each event needs {list(_EVENT_KEYS)}")
    if e["lane"] not in ("copy", "compute"):
        raise ValueError(f"event log {source!r}: lane {e['lane']!r} must be 'copy' or 'compute'")
    out = dict(e)
    out.update(step=int(e["step"]), block=int(e["block"]), start_ms=float(e["start_ms"]), end_ms=float(e["end_ms"]))
    return out


# -------------------------------------------------------------------- live view

def format_status(latest: dict, width: int | None = None) -> str:
    """One status line: elapsed time, then per GPU used/total GB, util, PCIe GB/s."""
    parts = [f"{latest['t']:7.1f}s"]
    for g in latest["gpus"]:
        used = "?" if g["used_bytes"] is None else f"{g['used_bytes'] / 1e9:.1f}"
        util = "?" if g["util_pct"] is None else f"{g['util_pct']:d}%"
        pcie = ""
        if g["rx_mbs"] is not None:
            pcie = f" H2D {g['rx_mbs'] / 1e3:.1f} D2H {g['tx_mbs'] / 1e3:.1f} GB/s"
        parts.append(f"GPU{g['index']} {used}/{g['total_bytes'] / 1e9:.0f} GB {util}{pcie}")
    if not latest["gpus"]:
        parts.append("no NVML")
    if latest.get("host_rss_bytes") is not None:
        parts.append(f"host RSS {latest['host_rss_bytes'] / 1e9:.1f} GB")
    line = " | ".join(parts)
    if width and len(line) > width:
        line = line[: max(width - 1, 0)] + "~"
    return line


class LiveView:
    """Refreshes one status line on a terminal (~2 Hz); on a non-terminal
    stream it writes a plain line every `plain_every_s` seconds instead."""

    def __init__(self, monitor: MemoryMonitor, stream=None, hz: float = 2.0, plain_every_s: float = 10.0):
        self.monitor, self.stream = monitor, stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.period = 1.0 / hz if self.tty else plain_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ws-live-view", daemon=True)

    def _run(self):
        while not self._stop.wait(self.period):
            self._draw()

    def _draw(self):
        if self.tty:
            try:
                width = os.get_terminal_size(self.stream.fileno()).columns
            except (OSError, ValueError):
                width = 120
            self.stream.write("\r\x1b[2K" + format_status(self.monitor.latest(), width))
        else:
            self.stream.write("[monitor] " + format_status(self.monitor.latest()) + "\n")
        self.stream.flush()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -------------------------------------------------------------------- CLI

def _load_event_files(events_dir: str) -> dict[str, list]:
    out = {}
    for path in sorted(glob.glob(os.path.join(events_dir, "events-*.json"))):
        name = os.path.basename(path)[len("events-"):-len(".json")]
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"[monitor] skipping unreadable event log {path}: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict):
            for k, v in data.items():
                out[f"{name}/{k}"] = v
        else:
            out[name] = data
    return out


def monitor_main(argv: list[str]) -> int:
    """`python -m weightstream monitor [--out DIR] [--hz N] [--devices 0,1] [--no-live] -- <command ...>`

    Runs the command, samples the GPUs meanwhile (live line on stderr), then
    writes DIR/trace.json and DIR/report.html (+ report.png). A cooperating
    command may write controller event logs to $WEIGHTSTREAM_EVENTS_DIR/events-<name>.json
    (a list of event dicts); they are attached to the trace. Returns the
    command's exit status.
    """
    if "--" in argv:
        split = argv.index("--")
        opts, command = argv[:split], argv[split + 1:]
    else:
        opts, command = argv, []
    p = argparse.ArgumentParser(prog="python -m weightstream monitor",
                                description="run a command and record GPU memory / utilisation / PCIe")
    p.add_argument("--out", default=None, help="output folder (default: weightstream-monitor-<time>)")
    p.add_argument("--hz", type=float, default=100.0, help="memory samples per second (default 100)")
    p.add_argument("--devices", default=None, help="CUDA device indices to sample, e.g. 0,1 (default: all visible)")
    p.add_argument("--no-live", action="store_true", help="no live status line")
    args = p.parse_args(opts)
    if not command:
        p.print_usage(sys.stderr)
        print("monitor: give the command to run after '--', e.g. monitor -- python train.py", file=sys.stderr)
        return 2
    out = args.out or "weightstream-monitor-" + datetime.now().strftime("%Y%m%d-%H%M%S")
    os.makedirs(out, exist_ok=True)
    devices = None if args.devices is None else [int(x) for x in args.devices.split(",") if x.strip()]
    env = dict(os.environ)
    env[EVENTS_DIR_ENV] = os.path.abspath(out)
    mon = MemoryMonitor(hz=args.hz, devices=devices)
    started = time.time()
    mon.start()
    try:
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as e:
            print(f"monitor: cannot run {command[0]!r}: {e}", file=sys.stderr)
            return 127
        mon.set_host_pid(proc.pid)
        live = LiveView(mon) if not args.no_live else None
        if live:
            live.__enter__()
        try:
            try:
                rc = proc.wait()
            except KeyboardInterrupt:
                proc.terminate()
                rc = proc.wait()
        finally:
            if live:
                live.__exit__(None, None, None)
    finally:
        mon.stop()
    for name, evs in _load_event_files(out).items():
        mon.attach_events(evs, name=name)
    meta = {"command": command, "returncode": rc, "cwd": os.getcwd(), "wall_s": time.time() - started}
    trace_path = os.path.join(out, "trace.json")
    trace = mon.save(trace_path, meta=meta)
    perfetto_path = os.path.join(out, "trace.perfetto.json")
    save_trace(to_perfetto(trace), perfetto_path)
    from weightstream.report import render_html

    paths = render_html(trace, os.path.join(out, "report.html"))
    s = trace_summary(trace)
    for g in s["gpus"]:
        print(f"[monitor] GPU{g['index']} {g['name']}: peak used {(g['peak_used_bytes'] or 0) / 1e9:.2f} / "
              f"{g['total_bytes'] / 1e9:.1f} GB, peak util {g['peak_util_pct']}%, peak H2D "
              f"{(g['peak_rx_mbs'] or 0) / 1e3:.1f} GB/s", file=sys.stderr)
    print(f"[monitor] {s['n_samples']} samples over {s['duration_s']:.1f} s; trace {trace_path}; "
          f"report {paths['html']}" + (f" ({paths['png']})" if paths.get("png") else "")
          + f"; Perfetto trace {perfetto_path} (open in ui.perfetto.dev)", file=sys.stderr)
    return rc
