"""Measured peaks of this machine (memory bandwidth, matmul FLOP/s): the denominators of MBU and MFU.

`peaks()` runs a probe of a few seconds once per (device, CPU/GPU model, threads, torch version) and
caches it in `cache_dir()/probe.json`; `refresh=True` measures again. Each number is the best of a few
repetitions: a slower run only means something else got in the way, so the fastest is the honest peak.
Run it on an otherwise idle machine (a busy core halves a two-thread result).

- Bandwidth (GB/s, 1e9 bytes): a STREAM-like read of a 512 MiB float32 buffer (16x a 32 MiB L3, so
  caches cannot flatter), filled with distinct values (no shared zero/duplicate pages). Two read
  kernels, whole-buffer `sum` and row-wise `amax`, and the faster one counts: on the 2-core EPYC dev
  box `sum` reads fastest on one thread but does not always split well over two. The CPU buffer is
  asked for on transparent huge pages (madvise): with torch's default 4 KiB pages the same read ran
  20-30% slower there (TLB misses under the VM's nested paging), which is a cost of the allocation,
  not a limit of the memory. On CUDA also a device-to-device copy (bytes read + written), timed
  with CUDA events.
- Matmul (GFLOP/s, 2*n^3 per product): square products in float32 (on CUDA as torch is set: TF32 off
  by default), bfloat16 and float16 (bfloat16 skipped on GPUs without it), n doubling
  from 256 until one product takes 40 ms (or n reaches 2048 on CPU, 8192 on CUDA), so that slow
  dtypes stay small: CPU float16 has no hardware path on x86 (~3 GFLOP/s) and stops at n=512.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leanlm.errors import LeanLMError
from leanlm.fetch import cache_dir
from leanlm.runtime import best_seconds, resolve_device

BANDWIDTH_BYTES = 512 << 20
MATMUL_START_N = 256
MATMUL_MAX_N = {"cpu": 2048, "cuda": 8192}
MATMUL_MIN_SECONDS = 0.04
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Peaks:
    """Peak rates measured on one device with one thread count."""

    device: str  # "cpu" or "cuda:0"
    threads: int  # torch intra-op threads during the measurement
    bandwidth_gbs: float  # memory read bandwidth, 1e9 bytes/s
    matmul_gflops: dict[str, float]  # dtype name -> 1e9 FLOP/s


def _device(device: str | torch.device) -> torch.device:
    """The runtime's device check, with the CUDA index made explicit (it is part of the cache key)."""
    dev = resolve_device(str(device))
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_name(device: str | torch.device = "cpu") -> str:
    """The hardware behind `device`: GPU name, or CPU model and logical core count."""
    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} ({os.cpu_count()} cpus)"


@contextlib.contextmanager
def _num_threads(threads: int | None):
    old = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise LeanLMError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _huge_page_floats(n: int) -> torch.Tensor:
    """A float32 CPU buffer on transparent huge pages where the OS allows (4 KiB pages cost ~20% here)."""
    try:
        mm = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        return torch.empty(n)
    return torch.frombuffer(mm, dtype=torch.float32)  # the tensor keeps `mm` alive


def measure_bandwidth(
    device: str | torch.device = "cpu", threads: int | None = None, nbytes: int = BANDWIDTH_BYTES, reps: int = 5
) -> float:
    """Peak memory read bandwidth in GB/s: the fastest of a few read kernels over an `nbytes` buffer."""
    dev = _device(device)
    n = max(nbytes // 4 // 1024, 1) * 1024
    with _num_threads(threads), torch.no_grad():
        buf = _huge_page_floats(n) if dev.type == "cpu" else torch.empty(n, device=dev)
        torch.arange(n, dtype=torch.float32, out=buf)  # distinct values: no shared pages
        rows = buf.view(-1, 1024)
        kernels = {
            "sum": (lambda: buf.sum(), 1),
            "amax": (lambda: rows.amax(dim=1), 1),
        }
        if dev.type == "cuda":
            dst = torch.empty_like(buf)
            kernels["copy"] = (lambda: dst.copy_(buf), 2)  # reads and writes every byte
        rates = {name: moved * n * 4 / best_seconds(fn, dev, reps) / 1e9 for name, (fn, moved) in kernels.items()}
    return max(rates.values())


def measure_matmul(
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    threads: int | None = None,
    max_n: int | None = None,
    reps: int = 3,
) -> float:
    """Peak matmul GFLOP/s for `dtype`: square n x n products, n grown until compute-bound (or `max_n`)."""
    dev = _device(device)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise LeanLMError(f"measure_matmul needs a floating-point dtype, got {dtype!r}")
    max_n = MATMUL_MAX_N[dev.type] if max_n is None else max_n
    n = min(MATMUL_START_N, max_n)
    with _num_threads(threads), torch.no_grad():
        warmup = True  # library start-up (thread pool, cuBLAS) must not look like a slow product
        while True:
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            # One product decides whether n is big enough; it is also the warm-up of the timed ones.
            if best_seconds(lambda: a @ b, dev, 1, warmup) >= MATMUL_MIN_SECONDS or n * 2 > max_n:
                return 2 * n**3 / best_seconds(lambda: a @ b, dev, reps, warmup=False) / 1e9
            n, warmup = n * 2, False


def _dtypes(dev: torch.device) -> tuple[str, ...]:
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return tuple(d for d in DTYPES if d != "bfloat16")
    return DTYPES


def measure_peaks(
    device: str | torch.device = "cpu",
    threads: int | None = None,
    nbytes: int = BANDWIDTH_BYTES,
    max_n: int | None = None,
) -> Peaks:
    """Run the probe now (no cache): bandwidth and matmul peaks with `threads` threads."""
    dev = _device(device)
    threads = torch.get_num_threads() if threads is None else threads
    with _num_threads(threads):
        bandwidth = measure_bandwidth(dev, threads, nbytes)
        matmul = {name: measure_matmul(dev, name, threads, max_n) for name in _dtypes(dev)}
    return Peaks(str(dev), threads, round(bandwidth, 2), {k: round(v, 2) for k, v in matmul.items()})


def cache_key(device: str | torch.device, threads: int, nbytes: int = BANDWIDTH_BYTES, max_n: int | None = None) -> str:
    """Key of one probe result: device, hardware, threads, torch version (and any non-default sizes)."""
    dev = _device(device)
    key = f"{dev}|{device_name(dev)}|threads={threads}|torch={torch.__version__}"
    if nbytes != BANDWIDTH_BYTES or max_n is not None:
        key += f"|bytes={nbytes}|max_n={max_n}"
    return key


def _load(path: Path) -> dict:
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # missing or damaged: the probe is cheap to redo
    return table if isinstance(table, dict) else {}


def peaks(
    device: str | torch.device = "cpu",
    threads: int | None = None,
    refresh: bool = False,
    *,
    nbytes: int = BANDWIDTH_BYTES,
    max_n: int | None = None,
) -> Peaks:
    """Peaks of `device` with `threads` threads (default: torch's current count), cached; `refresh` re-measures."""
    threads = torch.get_num_threads() if threads is None else threads
    key = cache_key(device, threads, nbytes, max_n)
    path = cache_dir() / "probe.json"
    if not refresh:
        with contextlib.suppress(TypeError, KeyError):
            return Peaks(**_load(path)[key])
    result = measure_peaks(device, threads, nbytes, max_n)
    table = _load(path)  # re-read: another process may have added entries meanwhile
    table[key] = asdict(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return result


if __name__ == "__main__":
    for t in range(1, (os.cpu_count() or 1) + 1):
        start = time.perf_counter()
        p = peaks("cpu", t, refresh=True)
        print(f"{p}  ({time.perf_counter() - start:.1f} s)")
    if torch.cuda.is_available():
        print(peaks("cuda", refresh=True))
