"""HQQ (Half-Quadratic Quantization): int4 groups fitted to the weights alone, no calibration data.

Each group's grid starts at its min-max range; then the solver refines the group's offset to minimise the
lp error ||W - dequant(quant(W))||_p^p with p < 1, a norm that lets a few outliers keep large errors so the bulk
of the group fits the grid. Half-quadratic splitting alternates two closed forms, with beta growing by kappa:

    E   = shrink_p(W - dequant(quant(W)), beta)        the outlier part of the error (generalised soft threshold)
    mid = mean over the group of (W - E - (q - 8) * scale)  the offset that fits the rest in least squares

https://mobiusml.github.io/hqq_blog/ (Badri & Shaji, 2023). The reference solves for zero points on its own
fp16 grid; this one solves in the int4 kernel's terms, w = (q - 8) * scale + mid, with scale and mid rounded to
bfloat16 as the kernel stores them, so the error minimised is the one the kernel computes with. Of the
reference's iterates the one with the lowest mean |error| is kept (it stops at the first that does not improve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.compress.quant.rtn import Int4Options, group_for
from leanlm.compress.registry import decoder_linears, register
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear
from leanlm.lowbit.record import replace


def shrink(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The proximal step of |x|^p / beta: sign(x) * max(|x| - |x|^(p-1) / beta, 0) (soft threshold at p = 1)."""
    a = x.abs()
    return x.sign() * (a - a.clamp_min(1e-12).pow(p - 1) / beta).clamp_min_(0)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def hqq_quantize(W: torch.Tensor, group_size: int, iters: int = 20, p: float = 0.7, beta: float = 10.0,
                 kappa: float = 1.01, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] 0..15, scale [N, K/g], mid [N, K/g]) of W [N, K] on 4-bit groups along K, with
    W ~ (codes - 8) * scale + mid. symmetric: mid stays 0 and only the absmax scale is used (nothing to solve)."""
    N, K = W.shape
    w = W.detach().float().reshape(N, K // group_size, group_size)
    if symmetric:
        scale = _bf16((w.abs().amax(-1) / 7).clamp_min(1e-12))
        mid = torch.zeros_like(scale)
        iters = 0
    else:
        lo, hi = w.amin(-1), w.amax(-1)
        scale = _bf16(((hi - lo) / 15).clamp_min(1e-12))
        mid = _bf16(lo + 8 * scale)
    s = scale[..., None]

    def codes_of(m: torch.Tensor) -> torch.Tensor:
        return ((w - m[..., None]) / s).round_().add_(8).clamp_(0, 15)

    best_mid, best_err = mid, float("inf")
    for _ in range(iters):
        q = codes_of(mid)
        err = w - ((q - 8) * s + mid[..., None])
        mean_err = err.abs().mean().item()
        if mean_err >= best_err:
            break
        best_mid, best_err = mid, mean_err
        outliers = shrink(err, beta, p)
        mid = _bf16((w - outliers - (q - 8) * s).mean(-1))
        beta *= kappa
    return codes_of(best_mid).to(torch.uint8).reshape(N, K), scale, best_mid


@dataclass(frozen=True)
class HQQ(Int4Options):
    """HQQ onto the W4A16 kernel: no calibration data; seconds for a model. Options as the reference's defaults:
    iters (20), lp_norm p (0.7), beta (10) and its growth kappa (1.01) per iteration."""

    name: ClassVar[str] = "hqq"
    iters: int = 20
    lp_norm: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.iters, int) or self.iters < 0:
            raise LeanLMError(f"hqq iters={self.iters!r} must be a whole number >= 0 (0: the min-max grid)")
        if not 0 < self.lp_norm <= 1:
            raise LeanLMError(f"hqq lp_norm={self.lp_norm!r} must be in (0, 1]")
        if not self.beta > 0 or not self.kappa >= 1:
            raise LeanLMError(f"hqq needs beta > 0 and kappa >= 1, got beta={self.beta!r}, kappa={self.kappa!r}")


@register(HQQ)
def hqq(model, config: HQQ, progress=None, samples=None) -> dict[str, dict]:
    records = {}
    for name, linear in list(decoder_linears(model)):
        g = group_for(linear.in_features, config.group_size)
        W4A16Linear.check_shape(linear.in_features, linear.out_features, g)
        codes, scale, mid = hqq_quantize(linear.weight, g, config.iters, config.lp_norm, config.beta, config.kappa,
                                         config.symmetric)
        new = config.activations(W4A16Linear.from_codes(linear, g, codes, scale, mid))
        replace(model, name, new)
        records[name] = new.record()
        if progress:
            progress(name)
    return records
