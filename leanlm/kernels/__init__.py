"""leanlm's C++ CPU kernel (cpu.cpp): the int8 weight-only matrix-vector product of W8A16 decode.

On a small model's matrices (576 x 576 to 49152 x 576) torch's `_weight_int8pack_mm` runs 1.5-2.5x slower than
ours (`python benchmarks/kernels.py`); torch's int4 kernel beat the int4 one we wrote, so W4A16 uses torch's. They are compiled for this machine (-march=native) on first use, ~10 s, and
cached by torch under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR). `ops()` is None where that fails
(no C++ compiler): callers then fall back to torch ops.

    ops = kernels.ops()
    y = ops.int8_gemv(x, w, scale)  # x [M, K], w [N, K] int8, scale [N] bf16 -> [M, N] float32
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
            print("leanlm: compiling the CPU kernel (once, ~10 s)", file=sys.stderr)
        with warnings.catch_warnings():  # cpp_extension's own deprecation notices are not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            load(name=f"{name}_kernels", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False)
    except Exception as e:  # no compiler, no headers: quantized layers fall back to torch ops (slower)
        warnings.warn(f"leanlm: CPU kernel not built ({type(e).__name__}: {str(e)[:200]}); "
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

    @torch.library.register_fake(f"{name}::int8_gemv")
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)
