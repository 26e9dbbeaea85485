"""Quantization math shared by every method: the grid (absmax or zero-point), its granularity,
quantize / dequantize, an integer matmul with zero-point corrections, and SQNR.

Integer matmul derivation: https://arxiv.org/abs/1712.05877 (Jacob et al., section 2.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from leanlm.errors import LeanLMError

GRANULARITIES = ("tensor", "channel", "group", "token")


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize a tensor: bit width, symmetric (absmax) or asymmetric (zero-point), granularity
    ("tensor"; "channel" = per output row of a weight [N, K]; "group" = `group_size` along K;
    "token" = per row of an activation [..., K]), and a clip ratio applied to the range."""

    bits: int = 8
    symmetric: bool = True
    granularity: str = "channel"
    group_size: int | None = None
    clip: float = 1.0

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise LeanLMError(f"quantization bits={self.bits!r} is not supported; use an integer from 2 to 8")
        if self.granularity not in GRANULARITIES:
            raise LeanLMError(f"granularity={self.granularity!r} is unknown; use one of {', '.join(GRANULARITIES)}")
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise LeanLMError(f"group_size={self.group_size!r} is invalid for group granularity; "
                                  "use a positive integer such as 32, 64 or 128")
        elif self.group_size is not None:
            raise LeanLMError(f"group_size={self.group_size} only applies to granularity='group', "
                              f"not {self.granularity!r}; leave it unset")
        if not 0.0 < self.clip <= 1.0:
            raise LeanLMError(f"clip={self.clip!r} is out of range; use a ratio in (0, 1]")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.symmetric else torch.uint8

    def row_block(self, K: int) -> int:
        """Entries along K that share a scale in one row of a weight [N, K]: the group, or the whole row."""
        return self.group_size if self.granularity == "group" else K

    def check(self, x: torch.Tensor) -> None:
        """Raise LeanLMError when `x` [..., K] cannot be quantized with this spec."""
        if x.dim() == 0:
            raise LeanLMError("cannot quantize a 0-d tensor; pass a tensor shaped [..., K]")
        if self.granularity == "group" and x.shape[-1] % self.group_size:
            K = x.shape[-1]
            fits = [g for g in (32, 64, 128, 256) if K % g == 0]
            raise LeanLMError(f"group_size={self.group_size} does not divide K={K}; "
                              f"use a divisor of {K}" + (f" such as {fits}" if fits else ""))


def _blocks(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View x so that each quantization block is one row of the last dim  # [..., B, blocksize]"""
    if spec.granularity == "tensor":
        return x.reshape(1, -1)
    if spec.granularity == "group":
        return x.reshape(*x.shape[:-1], x.shape[-1] // spec.group_size, spec.group_size)
    return x.unsqueeze(-2)  # channel / token: one block per row


def _params_shape(x: torch.Tensor, spec: QuantSpec) -> tuple[int, ...]:
    if spec.granularity == "tensor":
        return ()
    if spec.granularity == "group":
        return (*x.shape[:-1], x.shape[-1] // spec.group_size)
    return (*x.shape[:-1], 1)


def compute_qparams(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and integer zero point (int32) of x [..., K]; shaped [] for tensor, [..., 1] for
    channel/token, [..., K/g] for group. Symmetric grids have zero = 0."""
    spec.check(x)
    xb = _blocks(x.detach().float(), spec)
    if spec.symmetric:
        amax = xb.abs().amax(-1) * spec.clip
        scale = amax.clamp(min=1e-12) / spec.qmax
        zero = torch.zeros_like(scale, dtype=torch.int32)
    else:  # the range always contains 0 so that 0 is exactly representable (padding, ReLU outputs)
        lo = xb.amin(-1).clamp(max=0) * spec.clip
        hi = xb.amax(-1).clamp(min=0) * spec.clip
        scale = (hi - lo).clamp(min=1e-12) / (spec.qmax - spec.qmin)
        zero = (spec.qmin - lo / scale).round().clamp(spec.qmin, spec.qmax).to(torch.int32)
    shape = _params_shape(x, spec)
    return scale.reshape(shape), zero.reshape(shape)


def search_qparams(x: torch.Tensor, spec: QuantSpec, steps: int = 20, max_shrink: float = 0.2,
                   norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Like compute_qparams, but each block's range is shrunk by the clip ratio in 1, ..., 1 - max_shrink
    (`steps` points) that minimises sum |x - dequantize(quantize(x))|^norm over the block: clipping a few
    large values buys a finer grid for all the others (the grid search of the GPTQ reference code).
    The ratio is chosen per block, so the result is not a single QuantSpec.clip."""
    best_scale, best_zero = compute_qparams(x, spec)
    xb = _blocks(x.detach().float(), spec)
    best_err = torch.full(xb.shape[:-1], math.inf, device=x.device)
    for i in range(steps):
        ratio = 1.0 - max_shrink * i / max(steps - 1, 1)
        s, z = compute_qparams(x, replace(spec, clip=spec.clip * ratio))
        err = (_blocks(dequantize(quantize(x, s, z, spec), s, z, spec), spec) - xb).abs_().pow_(norm).sum(-1)
        better = (err < best_err).reshape(s.shape)
        best_scale, best_zero = torch.where(better, s, best_scale), torch.where(better, z, best_zero)
        best_err = torch.minimum(err, best_err)
    return best_scale, best_zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """round(x / scale) + zero, clamped to the grid; int8 (symmetric) or uint8 (asymmetric)  # same shape as x"""
    spec.check(x)
    xb = _blocks(x.float(), spec)
    s = scale.float().reshape(*xb.shape[:-1], 1)
    z = zero.float().reshape(*xb.shape[:-1], 1)
    q = (xb / s).round_().add_(z).clamp_(spec.qmin, spec.qmax)
    return q.reshape(x.shape).to(spec.storage_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero) * scale  # same shape as q"""
    qb = _blocks(q.float(), spec)
    s = scale.float().reshape(*qb.shape[:-1], 1)
    z = zero.float().reshape(*qb.shape[:-1], 1)
    return ((qb - z) * s).reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Quantize then dequantize x, returned in x's dtype  # same shape as x"""
    scale, zero = compute_qparams(x, spec)
    return dequantize(quantize(x, scale, zero, spec), scale, zero, spec, dtype=x.dtype)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 20 log10(||x|| / ||x - x_hat||) in dB (inf when equal)."""
    x, x_hat = x.double(), x_hat.double()
    noise = torch.linalg.vector_norm(x - x_hat).item()
    signal = torch.linalg.vector_norm(x).item()
    return math.inf if noise == 0 else 20 * math.log10(signal / noise)


def _int_mm_fits(M: int, K: int, N: int, device: torch.device) -> bool:
    """torch._int_mm on CPU takes any shape (checked in torch 2.13); the CUDA kernel needs M > 16 and K, N % 8 == 0."""
    return device.type == "cpu" or (M > 16 and K % 8 == 0 and N % 8 == 0)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact a @ b.T with int32 accumulation.  a [M, K] int8, b [N, K] int8 -> [M, N] int32"""
    M, K = a.shape
    N = b.shape[0]
    if _int_mm_fits(M, K, N, a.device):
        return torch._int_mm(a, b.t())
    # Zero padding changes no dot product; it only lifts the shapes into what the kernel accepts.
    Mp, Kp, Np = max(M, 17), -(-K // 8) * 8, -(-N // 8) * 8
    ap = torch.nn.functional.pad(a, (0, Kp - K, 0, Mp - M))
    bp = torch.nn.functional.pad(b, (0, Kp - K, 0, Np - N))
    return torch._int_mm(ap, bp.t())[:M, :N]


def _as_signed(q: torch.Tensor, zero: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shift a uint8 grid by -128 (and its zero point with it) so int8 kernels apply; q - zero is unchanged."""
    if q.dtype == torch.uint8:
        q = (q.to(torch.int16) - 128).to(torch.int8)
        zero = None if zero is None else zero.to(torch.int32) - 128
    return q, zero


def int_matmul_reference(x_q: torch.Tensor, s_x: torch.Tensor, z_x: torch.Tensor | None,
                         w_q: torch.Tensor, s_w: torch.Tensor, z_w: torch.Tensor | None,
                         bias: torch.Tensor | None = None, out_scale: float | torch.Tensor | None = None,
                         out_zero: int = 0, out_spec: QuantSpec | None = None) -> torch.Tensor:
    """Y = s_x s_w [sum X_q W_q - z_w sum X_q - z_x sum W_q + K z_x z_w] (+ bias), integer sums in int32.
    x_q [M, K] int8/uint8 with s_x, z_x per tensor [] or per token [M, 1]; w_q [N, K] with s_w, z_w per
    tensor [] or per channel [N, 1]; z = None means a symmetric grid (no correction terms).
    Returns float32 [M, N]; with out_scale, the requantized Y_q = z_Y + round(Y / s_Y) on `out_spec`'s grid
    (default int8 symmetric range when out_zero == 0, else uint8)."""
    x_q, z_x = _as_signed(x_q, z_x)
    w_q, z_w = _as_signed(w_q, z_w)
    M, K = x_q.shape
    N = w_q.shape[0]
    acc = int8_matmul(x_q, w_q)  # [M, N] int32
    zx = None if z_x is None else z_x.to(torch.int32).reshape(-1, 1)  # [M or 1, 1]
    zw = None if z_w is None else z_w.to(torch.int32).reshape(1, -1)  # [1, N or 1]
    if zw is not None:
        acc = acc - zw * x_q.sum(-1, keepdim=True, dtype=torch.int32)
    if zx is not None:
        acc = acc - zx * w_q.sum(-1, dtype=torch.int32).reshape(1, N)
    if zx is not None and zw is not None:
        acc = acc + K * zx * zw
    y = acc.float() * s_x.float().reshape(-1, 1) * s_w.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    if out_scale is None:
        return y
    spec = out_spec or QuantSpec(8, symmetric=out_zero == 0, granularity="tensor")
    out_scale = torch.as_tensor(out_scale, dtype=torch.float32, device=y.device)
    return (y / out_scale).round_().add_(out_zero).clamp_(spec.qmin, spec.qmax).to(spec.storage_dtype)
