"""llama.cpp's k-quants, written by leanlm from float weights with an importance matrix.

A k-quant cuts each row into super-blocks of 256 weights and those into sub-blocks of 16 or 32, each with its own
scale (and minimum, for the asymmetric types); the sub-block scales are themselves integers under one float16 scale
per super-block, so a scale costs 4-8 bits instead of 16:

    type  sub-block  codes             sub-block scale (and minimum)   bits per weight
    Q2_K  16         2-bit, w = d q - m  4-bit (and 4-bit minimum)    2.625
    Q3_K  16         3-bit signed        6-bit signed                 3.4375
    Q4_K  32         4-bit, w = d q - m  6-bit (and 6-bit minimum)    4.5
    Q5_K  32         5-bit, w = d q - m  6-bit (and 6-bit minimum)    5.5
    Q6_K  16         6-bit signed        int8                         6.5625

A row whose length 256 does not divide falls back to a 32-weight type, as llama-quantize does: Q2_K and Q3_K to
Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0. The mixtures (Q4_K_M and the rest) give some tensors more bits:
see `tensor_type`.

Fitting, per sub-block of weights x with importances w (the importance matrix's mean squared input of each column,
times sqrt(sigma^2 + x^2) so a large weight counts more; 1 for every column without a matrix):
    1. a grid of candidate scales around the range's; codes by rounding; the scale (and minimum) that minimise the
       weighted error for those codes in closed form; the candidate with the least weighted error wins;
    2. the sub-block scales (and minima) quantized the same way under the super-block's float16 scale, weighted by
       each sub-block's total importance;
    3. every code rounded again under the scales as stored.
Everything runs on whole tensors at once (all sub-blocks of all rows together). `quantize` returns the bytes and
the weights they dequantize to; tests check those against the gguf package's dequantizers.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

QK = 256  # weights per super-block
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
MIXTURES = {"Q2_K": Q.Q2_K, "Q3_K_M": Q.Q3_K, "Q4_K_M": Q.Q4_K, "Q5_K_M": Q.Q5_K, "Q6_K": Q.Q6_K}


# ---- which type each tensor gets ---------------------------------------------------------------------------------

def _more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp's _M mixtures give more bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mixture: str, name: str, K: int, n_layers: int, gqa: int, tied: bool) -> Q:
    """The GGUF type of the 2-D weight `name` (a GGUF name, K inputs) in a `mixture` file, as llama-quantize
    chooses it for a llama/qwen2 model with `n_layers` blocks and `gqa` query heads per KV head."""
    base = MIXTURES[mixture]
    part = name.rsplit(".", 2)[-2] if name.startswith("blk.") else name.split(".")[0]
    i = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if part == "output" or (part == "token_embd" and tied):
        return Q.Q8_0 if K % QK else Q.Q6_K
    kind = base
    if part == "attn_v":
        kind = {"Q2_K": Q.Q4_K if gqa >= 4 else Q.Q3_K, "Q3_K_M": Q.Q5_K if i < 2 else Q.Q4_K,
                "Q4_K_M": Q.Q6_K if _more_bits(i, n_layers) else base,
                "Q5_K_M": Q.Q6_K if _more_bits(i, n_layers) else base}.get(mixture, base)
    elif part == "ffn_down":
        kind = {"Q2_K": Q.Q3_K, "Q3_K_M": Q.Q5_K if i < n_layers // 16 else Q.Q4_K,
                "Q4_K_M": Q.Q6_K if _more_bits(i, n_layers) else base,
                "Q5_K_M": Q.Q6_K if _more_bits(i, n_layers) else base}.get(mixture, base)
    elif part == "attn_output":
        kind = {"Q2_K": Q.Q3_K, "Q3_K_M": Q.Q4_K}.get(mixture, base)
    return FALLBACK[kind] if K % QK and kind in FALLBACK else kind


# ---- fitting: pure functions on [B, n] sub-blocks ---------------------------------------------------------------

def _fit_signed(x: torch.Tensor, w: torch.Tensor, nmax: int, steps: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ s * l with codes l in [-nmax, nmax - 1]: the sub-block's largest |x| maps to about -nmax (the longer
    side of the range); 2 * steps + 1 candidate scales 0.1 code apart  # x, w [B, n] -> s [B], l [B, n]"""
    big = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude [B, 1]
    safe = torch.where(big == 0, torch.ones_like(big), big)
    best = torch.full_like(big[:, 0], -1.0)
    scale, codes = torch.zeros_like(big[:, 0]), torch.zeros_like(x)
    for t in range(-steps, steps + 1):
        l = torch.round(-(nmax + 0.1 * t) / safe * x).clamp(-nmax, nmax - 1)
        lx, l2 = (w * x * l).sum(-1), (w * l * l).sum(-1)
        gain = torch.where(l2 > 0, lx * lx / l2.clamp_min(1e-30), torch.zeros_like(l2))  # error saved by the fit
        better = gain > best
        best = torch.where(better, gain, best)
        scale = torch.where(better, lx / l2.clamp_min(1e-30), scale)
        codes = torch.where(better[:, None], l, codes)
    return scale, codes


def _fit_offset(x: torch.Tensor, w: torch.Tensor, nmax: int, steps: int = 36) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ s * l - m with codes l in [0, nmax] and m >= 0: steps + 1 candidate scales from 0.9 code below the
    range's to 0.9 above, each with the weighted least-squares s and m for its codes  # x, w [B, n] -> s, m [B]"""
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1)
    span = (hi - lo).clamp_min(1e-30)
    sw, sx = w.sum(-1), (w * x).sum(-1)

    def error(s, m, l):
        return (w * (s[:, None] * l - m[:, None] - x) ** 2).sum(-1)

    s, m = span / nmax, -lo
    best = error(s, m, torch.round((x - lo[:, None]) / s[:, None]).clamp(0, nmax))
    for t in range(steps + 1):
        l = torch.round((nmax - 0.9 + 0.05 * t) / span[:, None] * (x - lo[:, None])).clamp(0, nmax)
        sl, sl2, sxl = (w * l).sum(-1), (w * l * l).sum(-1), (w * x * l).sum(-1)
        D = sw * sl2 - sl * sl
        ok = D > 0
        D = torch.where(ok, D, torch.ones_like(D))
        ts, tmin = (sw * sxl - sx * sl) / D, (sl2 * sx - sl * sxl) / D  # x ~ ts * l + tmin
        clip = tmin > 0  # the minimum must not be positive: codes start at 0
        ts = torch.where(clip, sxl / sl2.clamp_min(1e-30), ts)
        tm = torch.where(clip, torch.zeros_like(tmin), -tmin)
        err = error(ts, tm, l)
        better = ok & (err < best)
        best, s, m = torch.where(better, err, best), torch.where(better, ts, s), torch.where(better, tm, m)
    flat = hi <= lo
    return torch.where(flat, torch.zeros_like(s), s), m


def _fit_unsigned(v: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative values v ~ d * L with integers L in [0, nmax] (sub-block scales under a super-block scale):
    the best of 9 candidate d near max / nmax, then codes moved one at a time while the weighted fit improves
    # v, w [S, k] -> d [S], L [S, k]"""
    top = v.amax(-1, keepdim=True)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    best, inv = None, None
    for t in range(-4, 5):
        i = (nmax + 0.1 * t) / safe
        err = (w * (v - torch.round(i * v).clamp(max=nmax) / i) ** 2).sum(-1)
        if best is None:
            best, inv = err, i
        else:
            better = (err < best)[:, None]
            best, inv = torch.where(better[:, 0], err, best), torch.where(better, i, inv)
    L = torch.round(inv * v).clamp(max=nmax)
    lx, l2 = (w * v * L).sum(-1), (w * L * L).sum(-1)
    for _ in range(5):  # coordinate moves: each code to its best value given the others' fit
        changed = False
        for j in range(v.shape[1]):
            wj, vj, Lj = w[:, j], v[:, j], L[:, j]
            slx, sl2 = lx - wj * vj * Lj, l2 - wj * Lj * Lj
            ok = (slx > 0) & (sl2 > 0)
            new = torch.round(vj * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp(max=nmax)
            nlx, nl2 = slx + wj * vj * new, sl2 + wj * new * new
            take = ok & (new != Lj) & (nlx * nlx * l2 > lx * lx * nl2)
            if take.any():
                changed = True
                L[:, j] = torch.where(take, new, Lj)
                lx, l2 = torch.where(take, nlx, lx), torch.where(take, nl2, l2)
        if not changed:
            break
    return torch.where(l2 > 0, lx / l2.clamp_min(1e-30), torch.zeros_like(lx)), L


def _half(x: torch.Tensor) -> torch.Tensor:
    """x as float16 would store it, back in float32"""
    return x.to(torch.float16).float()


def _importance(x: torch.Tensor, qw: torch.Tensor, sub: int, sigma_scale: float) -> torch.Tensor:
    """Per-weight importance qw * sqrt(sigma^2 + x^2), sigma^2 = sigma_scale * the super-block's mean x^2
    # x [S, 256], qw [S, 256] -> [S, 256 / sub, sub]"""
    sigma2 = sigma_scale * x.square().mean(-1, keepdim=True)
    return (qw * torch.sqrt(sigma2 + x.square())).reshape(x.shape[0], -1, sub)


# ---- the types: x [N, K] float32, qw [K] -> (bytes [N, row bytes] uint8, dequantized [N, K]) --------------------

def _u8(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.uint8).contiguous().numpy()


def _f16(x: torch.Tensor) -> np.ndarray:
    """[S] -> float16 bytes [S, 2]"""
    return x.to(torch.float16).contiguous().numpy().view(np.uint8).reshape(-1, 2)


def _pack_bits(q: torch.Tensor, bits: int, stride: int) -> torch.Tensor:
    """Codes [S, 256] (< 2^bits) -> bytes [S, 256 * bits / 8]: within each run of 8 / bits * stride codes, byte j
    holds codes j, j + stride, j + 2 stride, ... from the lowest bits up (llama.cpp's interleave)"""
    per = 8 // bits
    q = q.to(torch.uint8).reshape(q.shape[0], -1, per, stride)
    out = torch.zeros(q.shape[0], q.shape[1], stride, dtype=torch.uint8)
    for k in range(per):
        out |= q[:, :, k] << (bits * k)
    return out.reshape(q.shape[0], -1)


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and eight 6-bit minima [S, 8] -> Q4_K/Q5_K's 12 bytes: bytes 0-3 scales 0-3 and 4-7
    minima 0-3 (low 6 bits each); bytes 8-11 the low nibbles of scale and minimum 4-7; their top 2 bits in the top
    2 bits of bytes 0-7"""
    ls, lm = ls.to(torch.uint8), lm.to(torch.uint8)
    first = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6)], 1)
    return torch.cat([first, (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], 1)


def _k_offset(x: torch.Tensor, qw: torch.Tensor, bits: int, sub: int, scale_bits: int, sigma_scale: float):
    """The asymmetric k-quants (Q2_K, Q4_K, Q5_K): codes [S, 256], d, dmin [S], integer scales and minima
    [S, 256 / sub], and the dequantized weights [S, 256]"""
    S, nmax = x.shape[0], 2 ** bits - 1
    w = _importance(x, qw, sub, sigma_scale)
    xs = x.reshape(S, -1, sub)
    s, m = _fit_offset(xs.reshape(-1, sub), w.reshape(-1, sub), nmax)
    sw = w.sum(-1)
    d, ls = _fit_unsigned(s.reshape(S, -1).clamp_min(0), sw, 2 ** scale_bits - 1)
    dmin, lm = _fit_unsigned(m.reshape(S, -1), sw, 2 ** scale_bits - 1)
    d, dmin = _half(d), _half(dmin)
    step, low = (d[:, None] * ls)[..., None], (dmin[:, None] * lm)[..., None]
    q = torch.round((xs + low) / torch.where(step > 0, step, torch.ones_like(step))).clamp(0, nmax)
    q = torch.where(step > 0, q, torch.zeros_like(q))
    return q.reshape(S, QK), d, dmin, ls, lm, (step * q - low).reshape(S, QK)


def q2_k(x: torch.Tensor, qw: torch.Tensor):
    q, d, dmin, ls, lm, back = _k_offset(x, qw, 2, 16, 4, 1.0)
    scales = (ls.to(torch.uint8) | (lm.to(torch.uint8) << 4))
    return [_u8(scales), _u8(_pack_bits(q, 2, 32)), _f16(d), _f16(dmin)], back


def q4_k(x: torch.Tensor, qw: torch.Tensor):
    q, d, dmin, ls, lm, back = _k_offset(x, qw, 4, 32, 6, 2.0)
    return [_f16(d), _f16(dmin), _u8(_pack_scales_k4(ls, lm)), _u8(_pack_bits(q, 4, 32))], back


def q5_k(x: torch.Tensor, qw: torch.Tensor):
    q, d, dmin, ls, lm, back = _k_offset(x, qw, 5, 32, 6, 2.0)
    high = (q.to(torch.uint8) >> 4).reshape(-1, 8, 32)  # bit 4 of code 32 k + j -> bit k of qh byte j
    qh = sum(high[:, k] << k for k in range(8))
    return [_f16(d), _f16(dmin), _u8(_pack_scales_k4(ls, lm)), _u8(qh), _u8(_pack_bits(q % 16, 4, 32))], back


def _k_signed(x: torch.Tensor, nmax: int, w: torch.Tensor, scales):
    """The symmetric k-quants (Q3_K, Q6_K) over sub-blocks of 16: `scales(s, sw)` quantizes the sub-block scales
    [S, 16] to (d [S], integers [S, 16]); codes in [-nmax, nmax - 1]"""
    S = x.shape[0]
    xs = x.reshape(S, 16, 16)
    s, _ = _fit_signed(xs.reshape(-1, 16), w.reshape(-1, 16), nmax)
    d, ls = scales(s.reshape(S, 16), w.sum(-1))
    step = (_half(d)[:, None] * ls)[..., None]
    q = torch.round(xs / torch.where(step != 0, step, torch.ones_like(step))).clamp(-nmax, nmax - 1)
    q = torch.where(step != 0, q, torch.zeros_like(q))
    return q.reshape(S, QK), _half(d), ls, (step * q).reshape(S, QK)


def q3_k(x: torch.Tensor, qw: torch.Tensor):
    q, d, ls, back = _k_signed(x, 4, _importance(x, qw, 16, 2.0), lambda s, sw: _fit_signed(s, sw, 32))
    u = (q + 4).to(torch.uint8)  # 0..7: the high bit is set where the code is >= 0
    hmask = sum(((u >> 2) & 1).reshape(-1, 8, 32)[:, k] << k for k in range(8))
    L = (ls + 32).to(torch.uint8)  # 16 6-bit scales: low nibbles two per byte, top 2 bits four per byte
    low = (L[:, :8] & 0xF) | ((L[:, 8:] & 0xF) << 4)
    top = sum((L.reshape(-1, 4, 4)[:, k] >> 4) << (2 * k) for k in range(4))
    return [_u8(hmask), _u8(_pack_bits(u & 3, 2, 32)), _u8(low), _u8(top), _f16(d)], back


def _int8_scales(s: torch.Tensor, sw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K's sub-block scales: int8 under d = (the signed largest) / -128"""
    big = s.gather(-1, s.abs().argmax(-1, keepdim=True))[:, 0]
    d = torch.where(big != 0, big / -128, torch.zeros_like(big))
    inv = torch.where(d != 0, 1 / _half(d), torch.zeros_like(d))  # the integers under d as stored
    return d, torch.round(inv[:, None] * s).clamp(-128, 127)


def q6_k(x: torch.Tensor, qw: torch.Tensor):
    w = qw.reshape(x.shape[0], 16, 16)  # Q6_K weighs by the importance matrix alone, as llama.cpp does
    q, d, ls, back = _k_signed(x, 32, w, _int8_scales)
    u = (q + 32).to(torch.uint8).reshape(-1, 2, 128)  # two halves of 128 codes
    ql = torch.cat([_pack_bits(u[:, h] % 16, 4, 64) for h in range(2)], 1)
    qh = torch.cat([_pack_bits(u[:, h] >> 4, 2, 32) for h in range(2)], 1)
    return [_u8(ql), _u8(qh), ls.to(torch.int8).numpy().view(np.uint8), _f16(d)], back


# ---- the 32-weight fallbacks ------------------------------------------------------------------------------------

def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [B, 32] -> 16 bytes: code j in the low nibble, code j + 16 in the high"""
    q = q.to(torch.uint8) & 0xF
    return q[:, :16] | (q[:, 16:] << 4)


def _fifth_bits(q: torch.Tensor) -> np.ndarray:
    """Bit 4 of codes [B, 32] -> a little-endian uint32 (4 bytes) per block"""
    return np.packbits(((q.to(torch.uint8) >> 4) & 1).numpy(), axis=-1, bitorder="little")


def _block32_signed(x: torch.Tensor, qw: torch.Tensor, nmax: int):
    B = x.shape[0]
    d, _ = _fit_signed(x, qw, nmax)
    d = _half(d)
    q = torch.round(x / torch.where(d != 0, d, torch.ones_like(d))[:, None]).clamp(-nmax, nmax - 1)
    q = torch.where(d[:, None] != 0, q, torch.zeros_like(q))
    return (q + nmax).reshape(B, 32), d, d[:, None] * q


def q4_0(x, qw):
    q, d, back = _block32_signed(x, qw, 8)
    return [_f16(d), _u8(_nibbles(q))], back


def q5_0(x, qw):
    q, d, back = _block32_signed(x, qw, 16)
    return [_f16(d), _fifth_bits(q), _u8(_nibbles(q))], back


def q5_1(x, qw):
    s, m = _fit_offset(x, qw, 31)
    d, mn = _half(s), _half(m)
    q = torch.round((x + mn[:, None]) / torch.where(d > 0, d, torch.ones_like(d))[:, None]).clamp(0, 31)
    q = torch.where(d[:, None] > 0, q, torch.zeros_like(q))
    return [_f16(d), _f16(-mn), _fifth_bits(q), _u8(_nibbles(q))], d[:, None] * q - mn[:, None]


def q8_0(x, qw):
    d = _half(x.abs().amax(-1) / 127)
    q = torch.round(x / torch.where(d > 0, d, torch.ones_like(d))[:, None]).clamp(-127, 127)
    return [_f16(d), q.to(torch.int8).numpy().view(np.uint8)], d[:, None] * q


# type -> (weights per block, importance sigma^2 scale for the 32-weight types, encoder)
ENCODERS = {Q.Q2_K: (QK, None, q2_k), Q.Q3_K: (QK, None, q3_k), Q.Q4_K: (QK, None, q4_k), Q.Q5_K: (QK, None, q5_k),
            Q.Q6_K: (QK, None, q6_k), Q.Q4_0: (32, 1.0, q4_0), Q.Q5_0: (32, 1.0, q5_0), Q.Q5_1: (32, 1.0, q5_1),
            Q.Q8_0: (32, None, q8_0)}


def quantize(w: torch.Tensor, qtype: Q, imatrix: torch.Tensor | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """A weight matrix [N, K] as `qtype` blocks: (bytes [N, row bytes] uint8, the weights they dequantize to [N, K]
    float32). `imatrix` [K]: each input column's mean squared activation (llama-imatrix's), or None (all equal)."""
    block, sigma, encode = ENCODERS[qtype]
    N, K = w.shape
    if K % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} weights, got {K}")
    x = w.float().reshape(-1, block)
    qw = (torch.ones(K) if imatrix is None else imatrix.float().clamp_min(0)).expand(N, K).reshape(-1, block)
    if sigma is not None:  # the 32-weight types weigh by the whole row's mean square (llama.cpp's)
        row = w.float().square().mean(-1, keepdim=True).expand(N, K).reshape(-1, block)
        qw = qw * torch.sqrt(sigma * row + x.square())
    parts, back = encode(x, qw)
    return np.concatenate(parts, axis=1).reshape(N, -1), back.reshape(N, K)

