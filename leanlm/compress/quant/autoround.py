"""AutoRound: int4 groups whose rounding and clipping are tuned by signed gradient descent on each block's output.

For every weight W of a decoder block, with V [N, K] in [-0.5, 0.5] and clip ratios alpha, beta [N, K/g] in
[0, 1] (all learned; V = 0 and alpha = beta = 1 is round-to-nearest; the package's bounds: with [0.5, 1], the
paper's, SmolLM2-135M ended at 28.761 perplexity against 28.457, 50 steps, benchmarks/frontier.py's windows):

    s = (alpha * max(W) - beta * min(W)) / 15,   z = round(-beta * min(W) / s)
    W~ = s * (clamp(round(W / s + V) + z, 0, 15) - z)

(with `symmetric`, the package's full-range grid, as llama.cpp's Q4_0: the larger of alpha * max(W) and
-beta * min(W) is put at code -8, s = -alpha * max(W) / 8 or -beta * min(W) / 8, codes -8..7, so every code is
used and the step is 1/8 of that extreme, not 1/7). The block, its weights replaced by W~ (rounding passed
straight through in the backward), is run on the inputs the already-quantized blocks give it, and its output is
fitted to the float model's output of that block (mean squared error) on mini-batches of the calibration windows;
each step moves every parameter by lr * sign(gradient), lr falling linearly to 0, and the parameters of the lowest
loss seen are kept. https://arxiv.org/abs/2309.05516 (Cheng et al., "Optimize Weight Rounding via Signed Gradient
Descent"; the `auto-round` package's defaults: 200 steps, mini-batches of 8, lr 1 / steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.compress.calibrate import DEFAULT_BATCH_SIZE, fit_block, reconstruct
from leanlm.compress.quant.rtn import Int4Options, group_for
from leanlm.compress.registry import register
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear
from leanlm.lowbit.record import replace


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (x.round() - x).detach()


class TunedWeight(nn.Module):
    """A projection whose weight is the int4 grid of its float weight under learned rounding offsets and clip ratios.
    Stands in for the Linear while its block is tuned; `grid()` gives the codes, scale and mid for the kernel."""

    def __init__(self, linear: nn.Linear, group_size: int, symmetric: bool):
        super().__init__()
        N, K = linear.weight.shape
        self.group_size, self.symmetric = group_size, symmetric
        self.bias = None if linear.bias is None else linear.bias.detach()  # a tensor, not a parameter to tune
        self.w = linear.weight.detach().float().reshape(N, K // group_size, group_size)
        self.v = nn.Parameter(torch.zeros_like(self.w))
        self.alpha = nn.Parameter(torch.ones(N, K // group_size, 1))  # of the largest weight
        self.beta = nn.Parameter(torch.ones(N, K // group_size, 1))  # of the smallest

    def _scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = self.w.amax(-1, keepdim=True).clamp_min(0) * self.alpha
        lo = self.w.amin(-1, keepdim=True).clamp_max(0) * self.beta
        if self.symmetric:  # negative when the largest weight is the extreme, so that it lands on code -8
            s = torch.where(hi > -lo, -hi, -lo) / 8
            return torch.where(s < 0, s.clamp_max(-1e-9), s.clamp_min(1e-9)), torch.zeros_like(s)
        s = ((hi - lo) / 15).clamp_min(1e-9)
        return s, _round_ste(-lo / s).clamp(0, 15)

    def _codes(self, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        lo, hi = (-8, 7) if self.symmetric else (0, 15)
        return (_round_ste(self.w / s + self.v) + z).clamp(lo, hi)

    def weight(self) -> torch.Tensor:
        s, z = self._scale_zero()
        return ((self._codes(s, z) - z) * s).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight().to(x.dtype), self.bias)

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        self.alpha.clamp_(0.0, 1.0)
        self.beta.clamp_(0.0, 1.0)

    @torch.no_grad()
    def grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K] 0..15, scale [N, K/g] > 0, mid [N, K/g]): weight = (codes - 8) * scale + mid."""
        s, z = self._scale_zero()
        codes = self._codes(s, z)
        if not self.symmetric:
            return codes.to(torch.uint8).flatten(1), s[..., 0], ((8 - z) * s)[..., 0]
        # c * s with s < 0 is (7 - c) * |s| + |s|: flipped codes, a positive scale and the weight at code 8 = |s|
        flip = s < 0
        codes = torch.where(flip, 7 - codes, codes + 8).to(torch.uint8).flatten(1)
        return codes, s.abs()[..., 0], torch.where(flip, -s, 0.0)[..., 0]


def tune_block(block: nn.Module, tuned: dict[str, TunedWeight], inputs: torch.Tensor, targets: torch.Tensor,
               rope: tuple, iters: int, lr: float, batch_size: int, generator: torch.Generator) -> float:
    """Signed gradient descent of the block's TunedWeights so that block(inputs) fits targets (calibrate.fit_block);
    the best parameters seen are left in place. Returns the loss of the last step. inputs, targets [n, T, d]."""
    params = [p for t in tuned.values() for p in t.parameters()]

    def update(step: int, grads: tuple[torch.Tensor, ...]) -> None:
        step_lr = lr * (1 - step / iters)
        for p, g in zip(params, grads):
            p.sub_(step_lr * g.sign())
        for t in tuned.values():
            t.clamp_()

    return fit_block(block, params, inputs, targets, rope, iters, batch_size, generator, update)


@dataclass(frozen=True)
class AutoRound(Int4Options):
    """AutoRound onto the W4A16 kernel. iters: signed-gradient steps per block (the package's default 200; each is
    one forward and backward of the block on `batch_size` windows); lr: the first step's size (default 1 / iters)."""

    name: ClassVar[str] = "autoround"
    needs_data: ClassVar[bool] = True
    iters: int = 200
    lr: float | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.iters, int) or self.iters < 0:
            raise LeanLMError(f"autoround iters={self.iters!r} must be a whole number >= 0 (0: round-to-nearest)")
        if self.lr is not None and not self.lr > 0:
            raise LeanLMError(f"autoround lr={self.lr!r} must be > 0")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise LeanLMError(f"autoround batch_size={self.batch_size!r} must be a whole number >= 1")


@register(AutoRound)
def autoround(model, config: AutoRound, progress=None, samples=None) -> dict[str, dict]:
    """Block by block (calibrate.reconstruct): each projection becomes a TunedWeight, the block is tuned on its
    output, then packed onto the W4A16 kernel."""
    generator = torch.Generator().manual_seed(config.seed)
    lr = config.lr or 1.0 / max(config.iters, 1)

    def step(i, block, linears, inputs, targets, rope, run):
        tuned = {}
        for name, linear in linears.items():
            g = group_for(linear.in_features, config.group_size)
            W4A16Linear.check_shape(linear.in_features, linear.out_features, g)
            tuned[name] = TunedWeight(linear, g, config.symmetric)
            replace(block, name, tuned[name])
        with torch.enable_grad():
            tune_block(block, tuned, inputs, targets, rope, config.iters, lr, config.batch_size, generator)
        return {name: config.activations(W4A16Linear.from_codes(linears[name], t.group_size, *t.grid()))
                for name, t in tuned.items()}

    return reconstruct(model, samples, step, progress)
