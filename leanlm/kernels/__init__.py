"""leanlm's C++ CPU kernels (cpu.cpp): the weight-only int8 and int4 products of W8A16 and W4A16.

Integer dot products (AVX-512 VNNI) on activations rounded to int16; on the default model's decode matrices
they read weights ~2x faster than torch's `_weight_int8pack_mm` and up to 1.6x faster than
`_weight_int4pack_mm_for_cpu` (`python benchmarks/kernels.py`). They are compiled for this machine
(-march=native) on first use, ~10 s, and cached by torch under ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR). `ops()` is None where that fails (no C++ compiler): callers then fall back to torch ops.

    ops = kernels.ops()
    y = ops.int8_gemv(x, w, scale)  # x [M, K], w [N, K] int8, scale [N] bf16 -> [M, N] float32
    y = ops.int4_gemv(x, packed, scales, zeros, g)  # packed [N, K/2] (linear.pack_int4), scales/zeros [K/g, N]
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
MAX_ROWS = 16  # rows of x up to which W8A16 runs the kernel; beyond, one bf16 GEMM on the codes (compute-bound)


_loaded: dict[bool, object] = {}  # portable -> op namespace or None (a plain dict: torch.compile traces ops())


def build(portable: bool = False):
    """Compile and load cpu.cpp once per process; return its op namespace, or None if it cannot be built here.
    portable: the plain-loop variant (namespace leanlm_portable), for tests of the non-AVX-512 path."""
    if portable not in _loaded:
        _loaded[portable] = _build(portable)
    return _loaded[portable]


def _build(portable: bool):
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch runs `ninja`; the pip package's binary may be off PATH (a venv)
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

    name = "leanlm_portable" if portable else "leanlm"
    flags = ["-O3", "-march=native", "-fopenmp", f"-DLEANLM_NS={name}"] + (["-DLEANLM_PORTABLE"] if portable else [])
    try:
        if not _built(name):
            print("leanlm: compiling the CPU kernels (once, ~10 s)", file=sys.stderr)
        with warnings.catch_warnings():  # cpp_extension's own deprecation notices are not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            load(name=f"{name}_kernels", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False)
    except Exception as e:  # no compiler, no headers: quantized layers fall back to torch ops (slower)
        warnings.warn(f"leanlm: CPU kernels not built ({type(e).__name__}: {str(e)[:200]}); "
                      "quantized layers fall back to slower torch paths")
        return None
    ns = getattr(torch.ops, name)
    _register_fakes(name)
    return ns


def ops():
    """leanlm's kernel ops (torch.ops.leanlm), or None where they cannot be built."""
    return build(False)


def _built(name: str) -> bool:
    """Whether torch's extension cache already holds a build (only to say that a first build takes a while)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: any failure just means "say it"

        return any(Path(_get_build_directory(f"{name}_kernels", False)).glob("*.so"))
    except Exception:
        return False


def _register_fakes(name: str) -> None:
    """Output shapes for torch.compile's tracing (the kernel itself runs at execution)."""

    def product(x, w, *_):  # x [M, K], w [N, ...] -> [M, N] float32, for both ops
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)

    for op in ("int8_gemv", "int4_gemv"):
        torch.library.register_fake(f"{name}::{op}", product)
