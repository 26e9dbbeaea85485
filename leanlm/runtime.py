"""Where and how a model runs: device choice, dtype default, and the thread count the runtime picks."""

from __future__ import annotations

import math
import mmap
import os
import sys
import time

import torch

from leanlm.errors import LeanLMError


def resolve_device(name: str | None = None) -> torch.device:
    """'cuda' when present unless told otherwise; a clear error for a device that is not there."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise LeanLMError(f"unknown device {name!r}; choose cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LeanLMError("--device cuda was asked for, but no CUDA GPU is available here; use --device cpu")
    return torch.device(name)


def _cpu_feature(check: str) -> bool:
    """torch's own CPU feature check by name (torch.cpu._is_..._supported), False where this torch has none."""
    return bool(getattr(torch.cpu, check, lambda: False)())


# Matrix-matrix products on x86 CPUs: bf16 has a fast path only with AVX512-BF16 or AMX, int8 (torch._int_mm) only
# with VNNI. Without them (a Zen 3, most laptops) a bf16 GEMM ran at 17 GFLOP/s and the same product upcast to
# float32 first at 77; torch._int_mm at 5.7 GOP/s, against 75 for leanlm's int8 kernel.
CPU_BF16_GEMM = _cpu_feature("_is_avx512_bf16_supported") or _cpu_feature("_is_amx_tile_supported")
CPU_INT8_GEMM = _cpu_feature("_is_vnni_supported")


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a matrix-matrix product of `dtype` operands runs in on `device`: float32 on a CPU for float16 (no
    x86 fp16 GEMM, ~3 GFLOP/s) and for bfloat16 without CPU_BF16_GEMM; `dtype` otherwise. The upcast is exact;
    only the accumulation gets finer."""
    no_gemm = dtype == torch.float16 or (dtype == torch.bfloat16 and not CPU_BF16_GEMM)
    return torch.float32 if device.type == "cpu" and no_gemm else dtype


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 everywhere: half of float32's bytes for the memory-bound decode, fp32's range; its prefill products run
    in float32 on CPUs without a bf16 GEMM (matmul_dtype)."""
    return torch.bfloat16


def parse_memory(size: str | int | float, device: torch.device) -> int:
    """Bytes from "2GiB", "512MB", a byte count, or a fraction in (0, 1) of the memory free on `device` now."""
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    value = -1.0
    if isinstance(size, str):
        text = size.strip().lower()
        number = text.rstrip("kmgib")
        try:
            value = float(number) * units.get(text[len(number):] or "b", -1)
        except ValueError:
            pass
    elif isinstance(size, (int, float)) and not isinstance(size, bool):
        value = float(size)
    if 0 < value < 1:
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return int(value * free)
    if value < 1:
        raise LeanLMError(f"memory size {size!r}: give bytes with a unit (e.g. 2GiB, 512MiB) or a fraction of free "
                          "memory such as 0.3")
    return int(value)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


PARENT_ENV = "LEANLM_PARENT_PID"  # set by a leanlm process for the leanlm processes it starts


def child_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) for a leanlm process started from this one, which follows it (follow_parent)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a process started with child_env (a variant server of `optimize`, a sweep's build): end by SIGTERM when
    the parent ends, even by SIGKILL (Linux's parent-death signal), so that no orphan keeps serving or building."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def set_threads(n: int) -> None:
    if n < 1:
        raise LeanLMError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)


def best_seconds(fn, dev: torch.device, reps: int, warmup: bool = True) -> float:
    """Fastest of `reps` timed calls of `fn`, after one untimed warm-up call."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(reps):
        if dev.type == "cuda":
            with torch.cuda.device(dev):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return best


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB. On Linux its VmHWM, the peak since exec: getrusage's ru_maxrss
    also carries the pre-exec image's, so a process started from a large parent would report the parent's peak."""
    peak = process_peak_rss_mb("self")
    if peak is None:
        import resource  # Unix only: at the top it would stop `import leanlm` on Windows

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return peak


def process_peak_rss_mb(pid: int | str) -> float | None:
    """A process's peak resident memory in MB (Linux's VmHWM; "self": this one), None where /proc has none."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return None


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings are real (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HUGE_PAGE = 2 << 20


def _padded(nbytes: int) -> int:
    """Bytes a tensor takes in an arena: each starts on a cache line, as torch's own allocations do."""
    return (nbytes + 63) // 64 * 64


def empty_on_huge_pages(specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor] | None:
    """Uninitialised CPU tensors of these shapes and dtypes, packed into one buffer backed by 2 MiB pages (Linux
    transparent huge pages), each 64-byte aligned; None where the OS has no madvise(MADV_HUGEPAGE). Decode reads
    every weight once per token: with 4 KiB pages that is a TLB miss every 4 KiB. On the default model the W4A16
    decode step took 8-11% less time this way, W8A16 7%, bf16 1.5% (one process, interleaved). Most weights are
    below the 2 MiB that torch's allocator needs before it asks for huge pages itself. Memory is committed as
    each tensor is first written, not here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    buf = mmap.mmap(-1, sum(map(_padded, sizes)) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off or not supported by this kernel
        return None
    arena = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf: the memory lives with the tensors
    at = -arena.data_ptr() % HUGE_PAGE
    out = []
    for (shape, dtype), nbytes in zip(specs, sizes):
        out.append(arena[at:at + nbytes].view(dtype).view(shape))
        at += _padded(nbytes)
    return out


def weights_on_huge_pages(model: torch.nn.Module) -> bool:
    """Move a CPU model's parameters and buffers into one buffer on 2 MiB pages (empty_on_huge_pages); True if
    it did, False (the model left as it is) where the OS cannot."""
    owners: dict[int, tuple[torch.Tensor, list]] = {}  # id -> (tensor, [(dict, name)]): a tied weight moves once
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0:
                    owners.setdefault(id(t), (t, []))[1].append((store, name))
    arena = empty_on_huge_pages([(t.shape, t.dtype) for t, _ in owners.values()]) if owners else None
    if arena is None:
        return False
    for key, moved in zip(list(owners), arena):  # one at a time, so that each old tensor is freed once copied
        t, places = owners.pop(key)
        moved.copy_(t)
        if isinstance(t, torch.nn.Parameter):
            moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
        for store, name in places:
            store[name] = moved
    return True
