"""Runtime quantized Linear modules: packed weights and scales as buffers, a fast CPU kernel in forward,
and `dequantized_weight()` (the float weight the kernel computes with) for checks.

Kernel facts measured on the 2-core Zen 4 box with torch 2.13:
- W8A16 decode (up to kernels.w8a16_rows(), measured once per machine; on AMX CPUs 8 rows, then AMX tiles) and W4A16
  run leanlm's kernels (leanlm/kernels): ~2x torch's `_weight_int8pack_mm` and up to 1.6x
  `_weight_int4pack_mm_for_cpu` on the default model's matrices (`benchmarks/kernels.py`).
  `_weight_int8pack_mm` (W8A16 without a C++ compiler) wants activations and scales in one dtype; it is ~10x
  slower with float32, so it runs in bf16.
- The int4 kernel also serves prefill: at 128-512 rows it is 1.2-2.4x slower than a bf16 GEMM but 2-6x faster
  than dequantizing the weight for one (qwen2.5-0.5b's MLP shapes, two threads).
- `torch._int_mm` on CPU accepts any shape; at M = 1 with the [N, K] weight passed as a transposed view it is
  ~6x faster than an int32 matmul and ~18x faster than padding M to 17 (4096x4096, one thread).

On an H200 (torch 2.11, `python benchmarks/gpu.py --sections k`): W4A16 decode runs torch's tinygemm
(`_weight_int4pack_mm`): 24-38 us at 1-32 rows of qwen2.5-0.5b's shapes, as fast as a bf16 GEMM and 3x faster than
dequantizing, but 9x slower at 512 rows, so prefill dequantizes. `_weight_int8pack_mm` is 2-250x slower than
dequantizing there, so W8A16 dequantizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanlm import kernels
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, int8_matmul, int_matmul_reference, quantize
from leanlm.lowbit.sparse24 import pack_24, unpack_24
from leanlm.runtime import CPU_INT8_GEMM, matmul_dtype

FP8_MAX = 448.0  # largest finite float8_e4m3fn
TINYGEMM_MAX_ROWS = 64  # CUDA W4A16: tinygemm up to this many rows, dequantize + GEMM beyond


def _check_linear(linear: nn.Module, name: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise LeanLMError(f"{name}.from_float needs an nn.Linear, got {type(linear).__name__}")


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def _per_channel_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows; the scale is rounded to `scale_dtype` first so q matches the scale stored.
    w [N, K] -> q [N, K] int8, scale [N]"""
    spec = QuantSpec(8, symmetric=True, granularity="channel")
    scale, zero = compute_qparams(w, spec)
    scale = scale.to(scale_dtype)
    return quantize(w, scale.float(), zero, spec), scale.reshape(-1)


def like_input(y: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A product y [M, N] of x [..., K] in x's dtype and leading dims [..., N], a cast or reshape only where it changes
    something (each no-op one cost microseconds, paid by every Linear of an eager decode step)."""
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], out_features)


class _QuantLinearBase(nn.Module):
    BITS = 8  # bits per weight, scales not counted
    SCALE_BITS = 32  # bits of scale (and zero point) stored per group of weights; a row is one group by default
    SCHEME = ""  # its name in quantization.json (SCHEMES below)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", bias)

    def row_splits(self) -> tuple[int, ...]:
        """Row counts after which forward takes another path on this machine (a compiled graph of a symbolic batch
        size must not span one: engine.compiled.row_ranges)."""
        return ()

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Add the bias and restore x's dtype and leading dims.  y [M, N] -> [..., N]"""
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return like_input(y, x, self.out_features)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul path (devices without a kernel).  x [..., K] -> [..., N]"""
        y = F.linear(x.reshape(-1, self.in_features), self.dequantized_weight().to(x.dtype))
        return self._finish(y, x)

    @property
    def bits_per_weight(self) -> float:
        """BITS plus the scales' share: the formula for this layer's resident weight memory."""
        return self.BITS + self.SCALE_BITS / getattr(self, "group_size", self.in_features)

    def options(self) -> dict:
        """Constructor keyword options beyond the shape and bias (what quantization.json must carry)."""
        return {}

    def record(self) -> dict:
        """This layer's entry in quantization.json: `cls(K, N, bias=..., **options)` rebuilds it empty."""
        return {"scheme": self.SCHEME, **self.options()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _many_rows_w8(x2d: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2d @ codes.T * scales past the rows int8_gemv serves (prefill, many sequences): AMX tiles where the CPU has
    them (kernels/amx.cpp), else one GEMM on the codes widened to bf16 (exact: |code| <= 127)."""
    if x2d.is_cpu and kernels.amx():
        return kernels.ops().int8_amx(x2d.to(torch.bfloat16).contiguous(), codes, scales.to(torch.bfloat16))
    cdt = matmul_dtype(torch.bfloat16, x2d.device)
    y = F.linear(x2d.to(cdt), codes.to(cdt))
    if x2d.is_cpu and cdt == torch.bfloat16 and (ops := kernels.ops()) is not None:
        return ops.rescale(y, None, scales)  # one pass: y.float() * scales.float()
    return y.float() * scales.float()


class W8A16Linear(_QuantLinearBase):
    """int8 per-channel symmetric weights, 16-bit activations. Decode runs leanlm's int8 kernel (kernels/cpu.cpp;
    torch's `aten._weight_int8pack_mm` where it cannot be built); more rows (prefill, many sequences) AMX tiles
    where the CPU has them, else one bf16 GEMM on the int8 codes (_many_rows_w8)."""

    SCHEME = "w8a16"
    SCALE_BITS = 16  # one bf16 scale per row

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))  # [N, K]
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16))  # [N]
        kernels.ops()  # built (or found) now, not first inside a compiled graph

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "W8A16Linear":
        _check_linear(linear, cls.__name__)
        m = cls(linear.in_features, linear.out_features, _bias(linear))
        m.weight, m.scales = _per_channel_int8(linear.weight.detach(), torch.bfloat16)
        return m.to(linear.weight.device)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        return self.weight.float() * self.scales.float()[:, None]

    def row_splits(self) -> tuple[int, ...]:
        return (kernels.w8a16_rows(),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:
            return self._reference(x)
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] > kernels.w8a16_rows():  # prefill, many sequences
            y = _many_rows_w8(x2d, self.weight, self.scales)
        elif (ops := kernels.ops()) is not None:  # decode, short prompts, speculative checks
            y = ops.int8_gemv(x2d, self.weight, self.scales)
        else:  # no C++ compiler here
            y = torch.ops.aten._weight_int8pack_mm(x2d.to(torch.bfloat16), self.weight, self.scales)
        return self._finish(y, x)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's layout (kernels/cpu.cpp): rows in tiles of 16; per tile and 4 columns k..k+3, 32 bytes
    where bytes 2i, 2i + 1 hold row i's (q[k] | q[k+2] << 4), (q[k+1] | q[k+3] << 4).
    q [N, K] in [0, 15], N % 16 == K % 4 == 0 -> [N, K/2] uint8"""
    N, K = q.shape
    t = q.to(torch.uint8).reshape(N // 16, 16, K // 4, 4).transpose(1, 2)  # [N/16, K/4, 16, 4]
    return (t[..., :2] | (t[..., 2:] << 4)).reshape(N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4.  [N, K/2] uint8 -> q [N, K] uint8"""
    N, K = packed.shape[0], packed.shape[1] * 2
    t = packed.reshape(N // 16, K // 4, 16, 2)
    return torch.cat([t & 15, t >> 4], -1).transpose(1, 2).reshape(N, K)


class W4A16Linear(_QuantLinearBase):
    """Asymmetric 4-bit weights in groups of 32/64/128 along K, 16-bit activations, leanlm's int4 kernel on CPU
    (kernels/cpu.cpp); past kernels.AMX_ROWS rows of bf16 x (many sequences, prefill) on AMX tiles (int4_amx, in
    kernels/amx.cpp), or without AMX from kernels.int4_packed_rows() rows on AVX512-BF16 its tiles widened into
    bf16_packed_gemm's blocks.  https://arxiv.org/abs/2210.17323 (group-wise int4 weight-only)"""

    GROUP_SIZES = (32, 64, 128)
    BITS = 4
    SCALE_BITS = 32  # bf16 scale and bf16 zero per group
    SCHEME = "w4a16"

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: torch.Tensor | None = None):
        super().__init__(in_features, out_features, bias)
        self.check_shape(in_features, out_features, group_size)
        self.group_size, G = group_size, in_features // group_size
        # w = (q - 8) * scale + zero: `zero` is the weight where q = 8 (mid-range, so bf16 holds it closely)
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(G, out_features, dtype=torch.bfloat16))  # [K/g, N]
        self.register_buffer("zeros", torch.zeros(G, out_features, dtype=torch.bfloat16))  # [K/g, N]
        self._tinygemm_weights = None  # CUDA: (device, weights in tinygemm's layout or None), made on first use
        kernels.ops()  # built (or found) now, not first inside a compiled graph

    @classmethod
    def check_shape(cls, in_features: int, out_features: int, group_size: int) -> None:
        """A LeanLMError unless the int4 kernel takes this layer."""
        if group_size not in cls.GROUP_SIZES:
            raise LeanLMError(f"W4A16 group_size={group_size} is not supported; use one of {cls.GROUP_SIZES}")
        if in_features % group_size:
            fits = [g for g in cls.GROUP_SIZES if in_features % g == 0]
            raise LeanLMError(f"W4A16 group_size={group_size} does not divide in_features={in_features}; "
                              + (f"use one of {fits}" if fits else "keep this layer in 8 or 16 bits"))
        if out_features % 16:
            raise LeanLMError(f"W4A16 needs out_features divisible by 16 (the int4 kernel's tiles), "
                              f"got {out_features}; keep this layer in 8 or 16 bits")

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 128, qparams=None, symmetric: bool = False
                   ) -> "W4A16Linear":
        """qparams: (scale, integer zero) [N, K/g] of a grid found elsewhere (GPTQ), instead of the weight's
        range. symmetric: the absmax grid (codes -8..7, zero 0), which the kernel holds as codes 0..15
        with the weight at code 8 equal to 0."""
        _check_linear(linear, cls.__name__)
        cls.check_shape(linear.in_features, linear.out_features, group_size)
        w = linear.weight.detach().float().cpu()
        spec = QuantSpec(4, symmetric=symmetric, granularity="group", group_size=group_size)
        scale, zero = compute_qparams(w, spec) if qparams is None else qparams  # [N, K/g]
        codes = quantize(w, scale, zero, spec).to(torch.int16) - spec.qmin  # 0..15
        # (c - z) s with c = code + qmin  =  (code - 8) s + (8 + qmin - z) s
        return cls.from_codes(linear, group_size, codes, scale, (8 + spec.qmin - zero.float()) * scale.float())

    @classmethod
    def from_codes(cls, linear: nn.Linear, group_size: int, codes: torch.Tensor, scale: torch.Tensor,
                   mid: torch.Tensor) -> "W4A16Linear":
        """The layer whose weight is (codes - 8) * scale + mid, for methods that choose their own codes (HQQ,
        AutoRound): codes [N, K] in 0..15, scale and mid (the weight at code 8) [N, K/g], stored in bfloat16."""
        _check_linear(linear, cls.__name__)
        m = cls(linear.in_features, linear.out_features, group_size, _bias(linear))
        m.weight_packed = pack_int4(codes.cpu())
        m.scales = scale.float().t().to(torch.bfloat16).contiguous()
        m.zeros = mid.float().t().to(torch.bfloat16).contiguous()
        return m.to(linear.weight.device)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        q = unpack_int4(self.weight_packed).float()
        g = self.group_size
        return (q - 8) * self.scales.float().t().repeat_interleave(g, 1) + self.zeros.float().t().repeat_interleave(g, 1)

    def row_splits(self) -> tuple[int, ...]:
        if kernels.amx():
            return kernels.AMX_ROWS, kernels.AMX_INT4_EXACT_ROWS
        return (kernels.int4_packed_rows() - 1,) if kernels.native_bf16() else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.numel() <= TINYGEMM_MAX_ROWS * self.in_features and \
                (weights := self._tinygemm_weights_on(x.device)) is not None:
            packed, scales_zeros = weights
            y = torch._weight_int4pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16), packed,
                                          self.group_size, scales_zeros)
            return self._finish(y, x)
        if not x.is_cpu or (ops := kernels.ops()) is None:
            return self._reference(x)
        x2d = x.reshape(-1, self.in_features)
        x2d = x2d.contiguous() if kernels.amx() else x2d  # the tiles read rows K apart (int4_gemv takes any strides)
        return self._finish(self._product(ops, x2d)(x2d, self.weight_packed, self.scales, self.zeros,
                                                    self.group_size), x)

    @staticmethod
    def _product(ops, x2d: torch.Tensor):
        """The kernel for these rows. The ISA is asked first: a row count compared where it changes nothing would
        still split a compiled graph. Past AMX_ROWS int4_amx's tiles are faster from 16 rows (175 against int4_gemv's
        246 us a layer, 241 / 449 against 446 / 853 at 32 / 64 rows: benchmarks/kernels.py --sections i), and past
        AMX_INT4_EXACT_ROWS the weight rounded to bf16 for plain AMX tiles. The widened packed tiles run on
        AVX512-BF16 only: scalar widening on AVX2, 1.6x int4_gemv's time at 256 rows (Zen 3)."""
        if kernels.amx() and x2d.dtype == torch.bfloat16:
            rows = x2d.shape[0]
            return ops.int4_gemv if rows <= kernels.AMX_ROWS else ops.int4_amx if rows <= kernels.AMX_INT4_EXACT_ROWS \
                else ops.int4_dequant_amx
        many = kernels.native_bf16() and x2d.dtype == torch.bfloat16 and x2d.shape[0] >= kernels.int4_packed_rows()
        return ops.int4_packed_gemm if many else ops.int4_gemv

    def _tinygemm_weights_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """CUDA: (packed weight, scales and zeros) in torch's tinygemm layout, whose grid is ours ((q - 8) * scale +
        zero per group), made once per device; None where the kernel does not take this layer or GPU."""
        if self._tinygemm_weights is None or self._tinygemm_weights[0] != device:
            fits = (self.in_features % 128 == 0 and self.out_features % 8 == 0
                    and hasattr(torch, "_weight_int4pack_mm") and torch.cuda.get_device_capability(device) >= (8, 0))
            weights = None
            if fits:
                q = unpack_int4(self.weight_packed.to(device))  # [N, K] in [0, 15]
                pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # even k in the high nibble, as the kernel reads
                weights = (torch._convert_weight_to_int4pack(pairs, 8),  # 8 inner k-tiles
                           torch.stack([self.scales, self.zeros], -1).to(device).contiguous())
            self._tinygemm_weights = device, weights
        return self._tinygemm_weights[1]

    def options(self) -> dict:
        return {"group_size": self.group_size}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


def per_token_int8(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d's dynamic per-token int8 codes (absmax / 127, round to nearest even), as ops.quantize_rows gives them.
    [M, K] -> [M, K] int8, [M, 1] float32"""
    spec = QuantSpec(8, symmetric=True, granularity="token")
    scale, zero = compute_qparams(x2d, spec)
    return quantize(x2d, scale, zero, spec), scale.float()


class W4A8Linear(W4A16Linear):
    """W4A16's int4 groups with int8 activations (per-token dynamic scales, as W8A8's), for the compute-bound rows
    (prefill, many sequences): on an AVX-512 VNNI CPU `pack_linears` makes it a PackedW4A8Linear, whose products run
    `vpdpbusd` (four int4-by-int8 products a lane per instruction, twice the 16-bit rate) on W4A16's bytes. This
    layer itself runs x's codes, dequantized, through W4A16's paths (whose int16 rounding moves them by at most 2^-16
    of a row's largest, and which sum in another order). QuaRot's W4A8 (arXiv 2404.00456) puts a rotation before
    it: `- {method: rotate}`."""

    SCHEME = "w4a8"

    @classmethod
    def from_w4a16(cls, layer: W4A16Linear) -> "W4A8Linear":
        """The same weight (the same tensors) with int8 activations."""
        m = cls(layer.in_features, layer.out_features, layer.group_size, layer.bias)
        m.weight_packed, m.scales, m.zeros = layer.weight_packed, layer.scales, layer.zeros
        return m.to(layer.weight_packed.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q, xs = per_token_int8(x.reshape(-1, self.in_features))
        return super().forward((x_q.float() * xs).to(x.dtype).reshape(x.shape))


class PackedW4A8Linear(W4A8Linear):
    """A W4A8Linear for inference on an AVX-512 VNNI CPU, its codes kept only in int4_q8_gemm's layout
    (kernels.pack_int4_q8: two vpdpbusd operands from one load, a mask and a shift), for every row count; x's
    per-token codes from quantize_rows. No backward; `weight_packed` unpacks a copy in W4A16's layout."""

    def __init__(self, layer: W4A8Linear, in_place: bool = False):
        """in_place: write the packed layout over the layer's own codes (see models.layers.PackedLinear)."""
        _QuantLinearBase.__init__(self, layer.in_features, layer.out_features, layer.bias)
        self.group_size = layer.group_size
        w = layer.weight_packed
        packed = kernels.pack_int4_q8(unpack_int4(w))  # [N/16, K/8, 16, 4], as many bytes as w
        self.register_buffer("packed", kernels.write_over(w, packed) if in_place else packed)
        self.register_buffer("scales", layer.scales)
        self.register_buffer("zeros", layer.zeros)
        self._tinygemm_weights = None

    @property
    def weight_packed(self) -> torch.Tensor:
        """The codes in W4A16's layout [N, K/2] (a copy)."""
        return pack_int4(kernels.unpack_int4_q8(self.packed))

    def row_splits(self) -> tuple[int, ...]:
        return ()  # one kernel at any row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if not (x2d.is_cpu and self.packed.is_cpu) or (ops := kernels.ops()) is None:  # moved since (model.to)
            return super().forward(x)
        x_q, xs = ops.quantize_rows(x2d)
        # in x's dtype by the kernel, or float32 where a bias is added first (one rounding, as W8A8)
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) and self.bias is None else torch.float32
        return self._finish(ops.int4_q8_gemm(x_q, xs, self.packed, self.scales, self.zeros, self.group_size, dtype),
                            x)


class W8A8Linear(_QuantLinearBase):
    """int8 per-channel weights x int8 activations (per-token dynamic scales, or one calibrated static scale),
    int32 accumulation, then rescaled: leanlm's int8 kernel up to the rows it was measured faster at (decode; on an
    AVX2 CPU `torch._int_mm` decoded at a third of bf16's speed), `torch._int_mm` beyond where the CPU has VNNI
    (runtime.CPU_INT8_GEMM), the kernel again where not.
    https://arxiv.org/abs/2211.10438 (W8A8 scheme)"""

    SCHEME = "w8a8"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None,
                 act_scale: float | None = None):
        super().__init__(in_features, out_features, bias)
        if act_scale is not None and not act_scale > 0:
            raise LeanLMError(f"W8A8 act_scale={act_scale!r} must be a positive float (or None for dynamic per-token)")
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))  # [N, K]
        self.register_buffer("scales", torch.ones(out_features))  # [N] float32
        self.register_buffer("act_scale", None if act_scale is None else torch.tensor(float(act_scale)))
        kernels.ops()  # built (or found) now, not first inside a compiled graph

    @classmethod
    def from_float(cls, linear: nn.Linear, act_scale: float | None = None) -> "W8A8Linear":
        _check_linear(linear, cls.__name__)
        m = cls(linear.in_features, linear.out_features, _bias(linear), act_scale)
        m.weight, m.scales = _per_channel_int8(linear.weight.detach(), torch.float32)
        return m.to(linear.weight.device)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        return self.weight.float() * self.scales[:, None]

    def quantize_input(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 activations and their scale.  x2d [M, K] -> q [M, K] int8, scale [M, 1] or []"""
        if self.act_scale is None:
            spec = QuantSpec(8, symmetric=True, granularity="token")
            scale, zero = compute_qparams(x2d, spec)
        else:
            spec = QuantSpec(8, symmetric=True, granularity="tensor")
            scale, zero = self.act_scale, torch.zeros((), dtype=torch.int32, device=x2d.device)
        return quantize(x2d, scale, zero, spec), scale

    def activation_codes(self, x2d: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """x2d's int8 codes and one float32 scale per row, for the CPU kernels: per-token codes in one op
        (bit-identical to quantize_input's), or the calibrated static scale on every row.  -> [M, K] int8, [M]"""
        if self.act_scale is None:
            return ops.quantize_rows(x2d)
        x_q, s_x = self.quantize_input(x2d)
        return x_q, s_x.float().reshape(-1).expand(x2d.shape[0]).contiguous()

    def int8_product(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d quantized to int8 times the int8 weight, int32 accumulation, rescaled.  [M, K] -> [M, N] float32"""
        M, ops = x2d.shape[0], kernels.ops() if x2d.is_cpu else None
        if ops is None:
            x_q, s_x = self.quantize_input(x2d)
            return int_matmul_reference(x_q, s_x.reshape(-1, 1) if s_x.dim() else s_x, None, self.weight, self.scales,
                                        None)
        x_q, xs = self.activation_codes(x2d, ops)
        # the kernel where it was measured faster (decode), torch._int_mm beyond, or wherever it has no fast path
        if M <= kernels.int8_rows() or not CPU_INT8_GEMM:
            return ops.int8_gemv_q8(x_q, xs, self.weight, self.scales)
        return ops.rescale(int8_matmul(x_q, self.weight), xs, self.scales)  # one pass over the sums

    def row_splits(self) -> tuple[int, ...]:
        return (kernels.int8_rows(),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(self.int8_product(x.reshape(-1, self.in_features)), x)

    def options(self) -> dict:
        return {} if self.act_scale is None else {"act_scale": float(self.act_scale)}


class PackedW8A8Linear(W8A8Linear):
    """A W8A8Linear for inference on an AVX-512 VNNI or AVX2 CPU, its codes kept only in int8_packed_gemm's layout
    (kernels.pack_int8) for every row count: the same bits as W8A8Linear's product, and faster than its paths from a
    few rows on (a SmolLM2-135M layer's gate_up_proj and down_proj from memory, 2 threads, benchmarks/kernels.py
    --sections q: Zen 4, 1.5x int8_gemv_q8 at one row, 1.6x at 32, 1.4-1.6x torch._int_mm at 256-1024; Zen 3 (AVX2),
    1.0x int8_gemv_q8 at one row, 1.2-1.6x at 8-1024). No backward; `weight` unpacks a copy of the codes."""

    def __init__(self, layer: W8A8Linear, in_place: bool = False):
        """in_place: write the packed layout over the layer's own codes (see PackedLinear)."""
        _QuantLinearBase.__init__(self, layer.in_features, layer.out_features, layer.bias)
        w = layer.weight
        packed = kernels.pack_int8(w)  # [N/16, K/4, 16, 4] uint8
        self.register_buffer("packed", kernels.write_over(w, packed) if in_place else packed)
        self.register_buffer("scales", layer.scales)
        self.register_buffer("act_scale", layer.act_scale)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 codes [N, K], unpacked (a copy)."""
        return kernels.unpack_int8(self.packed)

    def row_splits(self) -> tuple[int, ...]:
        return (kernels.AMX_INT8_ROWS,) if self._amx() else ()  # else one kernel at any row count

    def _amx(self) -> bool:
        return kernels.amx() and self.in_features % 64 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if not (x2d.is_cpu and self.packed.is_cpu) or (ops := kernels.ops()) is None:  # moved since (model.to)
            return self._finish(self.int8_product(x2d), x)
        x_q, xs = self.activation_codes(x2d, ops)
        # in x's dtype by the kernel, or float32 where a bias is added first (one rounding, as W8A8Linear)
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) and self.bias is None else torch.float32
        # AMX-INT8 tiles on the same layout past a few rows: the same bits
        product = ops.int8_packed_amx if self._amx() and x2d.shape[0] > kernels.AMX_INT8_ROWS else ops.int8_packed_gemm
        return self._finish(product(x_q, xs, self.packed, self.scales, dtype), x)


class PackedW8A16Linear(W8A16Linear):
    """A W8A16Linear for inference on an AVX-512 VNNI or AVX2 CPU, its codes kept only in w8a16_packed_gemm's layout
    (kernels.pack_pairs) for every row count: x rounded to int16 as int8_gemv rounds it, products by `vpdpwssd`
    (AVX2: `vpmaddwd`) on packed tiles with no horizontal sums, and no bf16 copy of the codes past int8_gemv's rows
    (W8A16Linear without AMX widens all its codes for each such product). A row's output does not depend on its
    batch, except on AMX CPUs past AMX_W8_PACKED_ROWS rows, where the codes are widened to bf16 for AMX tiles against
    x's bf16 rows (w8a16_packed_amx). No backward; `weight` unpacks a copy of the codes."""

    def __init__(self, layer: W8A16Linear, in_place: bool = False):
        """in_place: write the packed layout over the layer's own codes (see PackedLinear)."""
        _QuantLinearBase.__init__(self, layer.in_features, layer.out_features, layer.bias)
        w = layer.weight
        packed = kernels.pack_pairs(w)  # [N/16, K/2, 16, 2] int8
        self.register_buffer("packed", kernels.write_over(w, packed) if in_place else packed)
        self.register_buffer("scales", layer.scales)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 codes [N, K], unpacked (a copy)."""
        return kernels.unpack_pairs(self.packed)

    def row_splits(self) -> tuple[int, ...]:
        return (kernels.AMX_W8_PACKED_ROWS,) if self._amx() else ()  # else one kernel at any row count

    def _amx(self) -> bool:
        return kernels.amx() and self.in_features % 32 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if not (x2d.is_cpu and self.packed.is_cpu) or (ops := kernels.ops()) is None:  # moved since (model.to)
            return self._reference(x)
        # in x's dtype by the kernel, or float32 where a bias is added first (one rounding, as W8A16Linear)
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) and self.bias is None else torch.float32
        if self._amx() and x2d.dtype == torch.bfloat16 and x2d.shape[0] > kernels.AMX_W8_PACKED_ROWS:
            return self._finish(ops.w8a16_packed_amx(x2d.contiguous(), self.packed, self.scales, dtype), x)
        return self._finish(ops.w8a16_packed_gemm(x2d, self.packed, self.scales, dtype), x)


def _scaled_mm_fits(x2d: torch.Tensor, N: int) -> bool:
    """torch._scaled_mm with row-wise scales needs a CUDA device of compute capability >= 9.0 and K, N divisible by 16."""
    return (x2d.is_cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(x2d.device) >= (9, 0)
            and x2d.shape[1] % 16 == 0 and N % 16 == 0)


class FP8Linear(_QuantLinearBase):
    """float8_e4m3fn weights with a per-channel scale; on CPU the weight is upcast on the fly,
    on CUDA (sm90+) `torch._scaled_mm` with per-token fp8 activations.  https://arxiv.org/abs/2209.05433
    On CPU this is a storage/accuracy format, not a fast one: torch's fp8 -> bf16 cast runs ~5 ns per weight
    (83 ms for 4096x4096 at M = 1 vs 3 ms for bf16 F.linear); prefer W8A16Linear there."""

    SCHEME = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))  # [N, K]
        self.register_buffer("scales", torch.ones(out_features))  # [N] float32

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "FP8Linear":
        _check_linear(linear, cls.__name__)
        m = cls(linear.in_features, linear.out_features, _bias(linear))
        w = linear.weight.detach().float()
        m.scales = (w.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
        m.weight = (w / m.scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return m.to(linear.weight.device)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        return self.weight.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if _scaled_mm_fits(x2d, self.out_features):
            s_x = (x2d.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [M, 1]
            x_f8 = (x2d.float() / s_x).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(x_f8, self.weight.t(), scale_a=s_x, scale_b=self.scales.reshape(1, -1),
                                 out_dtype=torch.bfloat16)
            return self._finish(y, x)
        # The per-channel scale is applied to the [M, N] output, not the [N, K] weight: one fewer pass over K.
        cdt = torch.float32 if x.dtype == torch.float32 else matmul_dtype(torch.bfloat16, x2d.device)
        y = F.linear(x2d.to(cdt), self.weight.to(cdt)) * self.scales.to(cdt)
        return self._finish(y, x)


class Int8OutlierLinear(W8A8Linear):
    """LLM.int8(): int8 per-channel (vector-wise) weights; the input columns holding any |x| >= threshold in the
    current batch are computed in 16 bits against the dequantized weight, the rest as dynamic per-token W8A8,
    and the two products are summed.  https://arxiv.org/abs/2208.07339 (mixed-precision decomposition)"""

    SCHEME = "llm_int8"
    compilable = False  # its outlier columns come from each batch's values (nonzero): no one graph (engine._compiled)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None, threshold: float = 6.0):
        super().__init__(in_features, out_features, bias)
        if not threshold > 0:
            raise LeanLMError(f"LLM.int8() threshold={threshold!r} must be positive, such as 6.0 (inf: plain W8A8)")
        self.threshold = float(threshold)

    @classmethod
    def from_float(cls, linear: nn.Linear, threshold: float = 6.0) -> "Int8OutlierLinear":
        _check_linear(linear, cls.__name__)
        m = cls(linear.in_features, linear.out_features, _bias(linear), threshold)
        m.weight, m.scales = _per_channel_int8(linear.weight.detach(), torch.float32)
        return m.to(linear.weight.device)

    def outlier_columns(self, x2d: torch.Tensor) -> torch.Tensor:
        """Indices of the input columns with any |x| >= threshold.  x2d [M, K] -> [C] int64"""
        return (x2d.abs() >= self.threshold).any(0).nonzero().squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        cols = self.outlier_columns(x2d)  # [C]
        if cols.numel() == 0:
            return self._finish(self.int8_product(x2d), x)
        y = self.int8_product(x2d.index_fill(1, cols, 0))  # [M, N] float32, outliers left out of the row scales
        cdt = matmul_dtype(x.dtype, x.device)  # 16-bit for the outliers, float32 on a CPU without a GEMM for it
        w = (self.weight[:, cols].float() * self.scales[:, None]).to(cdt)  # [N, C]
        y = y + (x2d[:, cols].to(cdt) @ w.T).float()
        return self._finish(y, x)

    def options(self) -> dict:
        return {"threshold": self.threshold}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", threshold={self.threshold}"


class W8A16Sparse24Linear(_QuantLinearBase):
    """W8A16Linear's int8 codes and bf16 row scales, 2:4-sparse and stored compactly (lowbit/sparse24.py:
    the 2 kept codes of every 4 inputs and a 4-bit position mask, 5 bits a weight): decode runs the int8_24_gemv
    kernel (kernels/sparse.cpp), which reads 0.625x the dense kernel's bytes and gives its results exactly;
    prefill unpacks the codes for one bf16 GEMM.  https://arxiv.org/abs/2104.08378 (2:4 sparsity)"""

    SCHEME = "w8a16_2:4"
    BITS = 5  # 4 bits of the 8-bit value and 1 of mask per weight
    SCALE_BITS = 16

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None):
        super().__init__(in_features, out_features, bias)
        if in_features % 4:
            raise LeanLMError(f"2:4 storage needs in_features divisible by 4, got {in_features}; keep this layer "
                              "as w8a16")
        self.register_buffer("values", torch.zeros(out_features, in_features // 2, dtype=torch.int8))  # [N, K/2]
        self.register_buffer("masks", torch.full((out_features, (in_features + 7) // 8), 0x33, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16))  # [N]
        kernels.ops()  # built (or found) now, not first inside a compiled graph

    @classmethod
    def from_w8(cls, dense: W8A16Linear, name: str = "the layer") -> "W8A16Sparse24Linear":
        """The same codes and scales in 2:4 storage; a LeanLMError where a group of 4 holds 3 or 4 nonzero codes."""
        m = cls(dense.in_features, dense.out_features, dense.bias)
        m.values, m.masks = pack_24(dense.weight.cpu(), name)
        m.scales = dense.scales.clone()
        return m.to(dense.weight.device)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "W8A16Sparse24Linear":
        """From a float Linear already pruned 2:4 (its zeros stay int8 zeros)."""
        return cls.from_w8(W8A16Linear.from_float(linear))

    def codes(self) -> torch.Tensor:
        """The dense int8 codes  # [N, K]"""
        if self.values.is_cpu and (ops := kernels.ops()) is not None:
            return ops.int8_24_unpack(self.values, self.masks)  # ~100x faster than unpack_24's torch ops
        return unpack_24(self.values, self.masks)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        return self.codes().float() * self.scales.float()[:, None]

    def row_splits(self) -> tuple[int, ...]:
        return (kernels.w8a16_rows(),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        # the same row count as W8A16Linear's, so that both take the same path and give the same logits
        if not x.is_cpu or x2d.shape[0] > kernels.w8a16_rows() or (ops := kernels.ops()) is None:
            y = _many_rows_w8(x2d, self.codes(), self.scales)  # on the dense codes, as W8A16Linear
        else:
            y = ops.int8_24_gemv(x2d, self.values, self.masks, self.scales)
        return self._finish(y, x)


SCHEMES = {cls.SCHEME: cls for cls in (W8A16Linear, W4A16Linear, W4A8Linear, W8A8Linear, FP8Linear,
                                         Int8OutlierLinear, W8A16Sparse24Linear)}


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of `model` that are quantized layers (these and lowbit.codebook's), by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _QuantLinearBase)}
