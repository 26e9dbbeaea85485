"""leanlm's C++ CPU kernels (cpu.cpp): int8 and int4 weight-only matrix-vector products for decode.

torch's own CPU kernels for these (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) reach only ~30% of
memory bandwidth on a small model's 576 x 1536 matrices; ours stream the weights near the bandwidth limit
(benchmarks/quantization.py). They are compiled for this machine (-march=native) on first use, ~10 s, and
cached by torch under ~/.cache/torch_extensions. `ops()` is None where that fails (no C++ compiler): callers
then fall back to torch's kernels.

    ops = kernels.ops()
    y = ops.int8_gemv(x, w, scale)                   # x [M <= 8, K], w [N, K] int8, scale [N] bf16 -> [M, N] fp32
    y = ops.int4_gemv(x, w, scale, mins, group_size)  # w [N, K/2] uint8 (layout in cpu.cpp), [N, K/g] bf16 each
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
MAX_ROWS = 8  # rows of x the kernels take (cpu.cpp kMaxRows)


_loaded: dict[bool, object] = {}  # portable -> op namespace or None (a plain dict: torch.compile traces ops())


def build(portable: bool = False):
    """Compile and load cpu.cpp once per process; return its op namespace, or None if it cannot be built here.
    portable: the plain-loop variant (namespace leanlm_portable), for tests of the non-AVX-512 path."""
    if portable not in _loaded:
        _loaded[portable] = _build(portable)
    return _loaded[portable]


def _build(portable: bool):
    from torch.utils.cpp_extension import load

    name = "leanlm_portable" if portable else "leanlm"
    flags = ["-O3", "-march=native", f"-DLEANLM_NS={name}"] + (["-DLEANLM_PORTABLE"] if portable else [])
    try:
        print("leanlm: compiling the CPU kernels (once, ~10 s)", file=sys.stderr) if not _built(name) else None
        with warnings.catch_warnings():  # cpp_extension's own deprecation notices are not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            load(name=f"{name}_kernels", sources=[str(SOURCE)], extra_cflags=flags, is_python_module=False)
    except Exception as e:  # no compiler, no headers: torch's kernels still work
        warnings.warn(f"leanlm: CPU kernels not built ({type(e).__name__}: {str(e)[:200]}); using torch's kernels")
        return None
    ns = getattr(torch.ops, name)
    _register_fakes(name)
    return ns


def ops():
    """The leanlm kernels, or None where they cannot be built."""
    return build(False)


def _built(name: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    return any(Path(_get_build_directory(f"{name}_kernels", False)).glob("*.so"))


def _register_fakes(name: str) -> None:
    """Output shapes for torch.compile's tracing (the kernels themselves run at execution)."""

    @torch.library.register_fake(f"{name}::int8_gemv")
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)

    @torch.library.register_fake(f"{name}::int4_gemv")
    def _(x, w, scale, mins, group_size):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)
