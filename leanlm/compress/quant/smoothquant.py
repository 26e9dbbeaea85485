"""SmoothQuant: move activation outliers into the weights with an exact per-channel rescaling, then W8A8.

Paper: https://arxiv.org/abs/2211.10438 (Xiao et al., eq. 4: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)).
Y = X W^T = (X diag(s)^-1) (W diag(s))^T; diag(s)^-1 folds into whatever produced X, so the float model
computes the same function while X / s has flatter channels for the per-token int8 activation grid.
Smoothed here: q/k/v (via input_layernorm), gate/up (via post_attention_layernorm), optionally down (via up's
rows); o_proj is not smoothed (on SmolLM2-135M its plain W8A8 costs ~0.1 perplexity of the 1.1 of all layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from leanlm.compress.calibrate import calibrate
from leanlm.compress.quant.rtn import quantize_decoder
from leanlm.compress.registry import register
from leanlm.compress.stats import AbsMax
from leanlm.errors import LeanLMError

MIN_SCALE = 1e-5  # as the reference implementation: no zero or denormal scales from dead channels


def smoothing_scale(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha).  act_absmax [K], weight [N, K] -> s [K] float32"""
    a = act_absmax.float().clamp(min=MIN_SCALE)
    w = weight.detach().float().abs().amax(0).clamp(min=MIN_SCALE)  # [K]
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=MIN_SCALE)


def fold(prev: torch.Tensor, nxt: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide the producer's output channels by s and multiply the consumer's input columns by s, in float32.
    prev [K] (a norm weight) or [K, D] (weight rows), nxt [N, K], s [K] -> (prev / s, nxt * s)"""
    return prev.float() / s.reshape(-1, *[1] * (prev.dim() - 1)), nxt.float() * s


def _fold_into(prev: torch.Tensor, nxt: torch.Tensor, s: torch.Tensor) -> None:
    """fold() in place, each result cast back to its tensor's dtype."""
    p, n = fold(prev, nxt, s)
    prev.copy_(p)
    nxt.copy_(n)


@torch.no_grad()
def smooth_block(block: nn.Module, absmax: dict[str, torch.Tensor], alpha: float, smooth_down: bool = False) -> None:
    """Smooth one Block in place. `absmax` holds the per-channel input max|x| of "self_attn.qkv_proj" [d],
    "mlp.gate_up_proj" [d] and (for smooth_down) "mlp.down_proj" [I], measured on the unmodified block."""
    attn, mlp = block.self_attn, block.mlp
    # Every scale from the unmodified weights first: the down fold rescales gate_up rows, and so its column maxes.
    s_qkv = smoothing_scale(absmax["self_attn.qkv_proj"], attn.qkv_proj.weight, alpha)  # [d]
    s_mlp = smoothing_scale(absmax["mlp.gate_up_proj"], mlp.gate_up_proj.weight, alpha)  # [d]
    if smooth_down:  # down's input is silu(gate) * up: exact to divide the up rows
        s_down = smoothing_scale(absmax["mlp.down_proj"], mlp.down_proj.weight, alpha)  # [I]
    _fold_into(block.input_layernorm.weight, attn.qkv_proj.weight, s_qkv)
    _fold_into(block.post_attention_layernorm.weight, mlp.gate_up_proj.weight, s_mlp)
    if smooth_down:
        up = mlp.gate_up_proj.weight[mlp.down_proj.in_features:]  # [I, d], a view
        _fold_into(up, mlp.down_proj.weight, s_down)


def smooth(model: nn.Module, samples: torch.Tensor, alpha: float = 0.7, smooth_down: bool = True,
           progress=None) -> None:
    """Smooth every block of a float model in place (an exact rewrite up to the weights' rounding).
    As in the paper, every scale comes from the activations of the unmodified model on `samples` [n, T]:
    the folds wait until calibration has seen all blocks, so no block is calibrated on smoothed (re-rounded)
    predecessors."""
    absmax = {}  # block index -> {linear name in the block: [K]}, a few KB per block

    def solve(index, block, linears):
        prefix = f"layers.{index}."
        absmax[index] = {name.removeprefix(prefix): stats.value for name, (_, stats) in linears.items()}
        if progress:
            for name in linears:
                progress(name)

    calibrate(model, samples, solve, lambda linear: AbsMax(linear.in_features))
    for index, block in enumerate(model.layers):
        smooth_block(block, absmax[index], alpha, smooth_down)


@dataclass(frozen=True)
class SmoothQuant:
    """Smooth with migration strength alpha (and down_proj through up's rows), then W8A8 with per-channel int8
    weights and per-token dynamic int8 activations. Defaults measured on SmolLM2-135M bf16 (32 x 512 calibration
    windows, perplexity on 2048 / 8192 evaluation tokens): bf16 28.62 / 29.08, plain W8A8 29.73 / 30.13;
    alpha 0.5 / 0.6 / 0.7 / 0.8 with smooth_down 29.02 / 29.06 / 28.73 / 29.04 (8192: 29.59 / 29.31 / 29.19 /
    29.51), without 29.58 / 29.27 / 29.19 / 29.15 (8192 at 0.7: 29.61)."""

    name: ClassVar[str] = "smoothquant"
    needs_data: ClassVar[bool] = True
    alpha: float = 0.7
    smooth_down: bool = True

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise LeanLMError(f"smoothquant alpha={self.alpha!r} is out of range; use a value in [0, 1] such as 0.5")


@register(SmoothQuant)
def smoothquant(model, config: SmoothQuant, progress=None, samples=None) -> dict[str, dict]:
    smooth(model, samples, config.alpha, config.smooth_down, progress)
    return quantize_decoder(model, "w8a8")


@dataclass(frozen=True)
class Smooth(SmoothQuant):
    """The smoothing alone (the float model computes the same function), for recipes that quantize next."""

    name: ClassVar[str] = "smooth"


@register(Smooth)
def smooth_only(model, config: Smooth, progress=None, samples=None) -> dict[str, dict]:
    smooth(model, samples, config.alpha, config.smooth_down, progress)
    return {}
